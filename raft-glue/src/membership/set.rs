//! [`MemberSet`]: the cluster's members, validated and persisted with etcd's rules.
//!
//! Storage, in the MVCC store's aux buckets, written in the same [`WriteTxn`] as the
//! consistent index of the entry that changed them:
//!
//! ```text
//! members          key = id:u64 big-endian (sorted by id)   value = listed member (member.rs)
//! members_removed  key = id:u64 big-endian                  value = version:u8 (=1) | removed_at:u64 LE
//! ```
//!
//! A listed member is the member's own encoding (version 1) unless it is a learner held from
//! automatic promotion, which version 2 of that encoding records in its flags (see
//! [`member`](super::member)); stores written before version 2 existed hold version 1 only,
//! and read as holding no learner.
//!
//! A learner is held from automatic promotion when its role was last set by a conf change
//! that carried no membership operation (a raw one): it joined as a learner through one
//! ([`add_joined`](MemberSet::add_joined)) or was demoted by one
//! ([`set_role`](MemberSet::set_role)). The hold ends when it stops being a learner
//! ([`MemberOp::Promote`], or a raw conf change making it a voter) or a member. Since every
//! member applies the same entries, every member holds the same learners; the hold travels
//! with the listed member in snapshots, as the members bucket does.

use std::collections::{BTreeMap, BTreeSet};

use keel_mvcc::{Backend, Bucket, Store, WriteTxn};

use super::member::{MEMBER_FORMAT, Member, MemberOp};
use super::{MembershipError, MembershipOptions};

/// The bucket holding the current members.
pub const MEMBERS_BUCKET: Bucket = Bucket::new("members");
/// The bucket holding the ids of removed members.
pub const REMOVED_BUCKET: Bucket = Bucket::new("members_removed");

/// The cluster's members, the learners among them held from automatic promotion, and the
/// ids of removed members.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MemberSet {
    members: BTreeMap<u64, Member>,
    /// Learners held from automatic promotion (module docs): always listed learners.
    held: BTreeSet<u64>,
    removed: BTreeMap<u64, u64>,
}

/// What applying a [`MemberOp`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Applied {
    /// The membership changed; the Raft conf change (if any) must be applied too.
    Changed,
    /// Nothing to do (an automatic promote of a member that is already a voter); the Raft
    /// conf change must be skipped.
    NoOp,
}

fn store_err(e: impl std::fmt::Display) -> MembershipError {
    MembershipError::Store(e.to_string())
}

fn id_from_key(what: &'static str, key: &[u8]) -> Result<u64, MembershipError> {
    let a: [u8; 8] = key.try_into().map_err(|_| MembershipError::Decode {
        what,
        reason: format!("key of {} bytes, expected 8", key.len()),
    })?;
    Ok(u64::from_be_bytes(a))
}

impl MemberSet {
    /// An empty set.
    pub fn new() -> MemberSet {
        MemberSet::default()
    }

    /// The initial members of a new cluster (not persisted; call [`MemberSet::persist_all`]).
    pub fn bootstrap(members: Vec<Member>) -> Result<MemberSet, MembershipError> {
        let mut set = MemberSet::new();
        for m in members {
            m.validate()?;
            set.validate_add(
                &m,
                &MembershipOptions {
                    max_learners: usize::MAX,
                    ..Default::default()
                },
            )?;
            set.members.insert(m.id, m);
        }
        Ok(set)
    }

    /// Loads the members and removed ids from `store`.
    pub fn load<B: Backend>(store: &Store<B>) -> Result<MemberSet, MembershipError> {
        let mut set = MemberSet::new();
        for (k, v) in store.aux_scan(&MEMBERS_BUCKET).map_err(store_err)? {
            let id = id_from_key("member key", &k)?;
            let (m, held) = Member::decode_listed(&v)?;
            if m.id != id {
                return Err(MembershipError::Decode {
                    what: "member",
                    reason: format!("stored under id {id:016x} but names {:016x}", m.id),
                });
            }
            if held {
                set.held.insert(id);
            }
            set.members.insert(id, m);
        }
        for (k, v) in store.aux_scan(&REMOVED_BUCKET).map_err(store_err)? {
            let id = id_from_key("removed member key", &k)?;
            if v.len() != 9 || v[0] != MEMBER_FORMAT {
                return Err(MembershipError::Decode {
                    what: "removed member",
                    reason: format!("value of {} bytes or unknown version", v.len()),
                });
            }
            let mut a = [0u8; 8];
            a.copy_from_slice(&v[1..9]);
            set.removed.insert(id, u64::from_le_bytes(a));
        }
        Ok(set)
    }

    /// Writes every member and removed id into `txn` (bootstrap, force-new-cluster).
    pub fn persist_all<B: Backend>(
        &self,
        txn: &mut WriteTxn<'_, B>,
    ) -> Result<(), MembershipError> {
        for m in self.members.values() {
            txn.put_aux(&MEMBERS_BUCKET, &m.id.to_be_bytes(), &self.encode_listed(m))
                .map_err(store_err)?;
        }
        for (id, at) in &self.removed {
            txn.delete_aux(&MEMBERS_BUCKET, &id.to_be_bytes())
                .map_err(store_err)?;
            txn.put_aux(&REMOVED_BUCKET, &id.to_be_bytes(), &removed_value(*at))
                .map_err(store_err)?;
        }
        Ok(())
    }

    /// The member with `id`.
    pub fn get(&self, id: u64) -> Option<&Member> {
        self.members.get(&id)
    }

    /// Every member, by id.
    pub fn members(&self) -> impl Iterator<Item = &Member> {
        self.members.values()
    }

    /// Whether `id` belonged to a removed member.
    pub fn is_removed(&self, id: u64) -> bool {
        self.removed.contains_key(&id)
    }

    /// Ids of voting members.
    pub fn voters(&self) -> BTreeSet<u64> {
        self.members
            .values()
            .filter(|m| !m.is_learner)
            .map(|m| m.id)
            .collect()
    }

    /// Ids of learners.
    pub fn learners(&self) -> BTreeSet<u64> {
        self.members
            .values()
            .filter(|m| m.is_learner)
            .map(|m| m.id)
            .collect()
    }

    /// Whether learner `id` is held from automatic promotion: its role was last set by a
    /// conf change that carried no membership operation (module docs). The leader does not
    /// promote it automatically; an explicit promotion still can.
    pub fn is_held(&self, id: u64) -> bool {
        self.held.contains(&id)
    }

    /// Ids of the learners held from automatic promotion (see [`is_held`](Self::is_held)).
    pub fn held_learners(&self) -> BTreeSet<u64> {
        self.held.clone()
    }

    /// `m` as this set lists it (`listed` in [`member`](super::member)'s format).
    fn encode_listed(&self, m: &Member) -> Vec<u8> {
        m.encode_listed(self.is_held(m.id))
    }

    /// Whether `id` is taken (a member now or removed): random ids skip these.
    pub fn is_taken(&self, id: u64) -> bool {
        self.members.contains_key(&id) || self.removed.contains_key(&id)
    }

    /// A new member with a random unused id, joining as a learner when asked or when
    /// [`MembershipOptions::learner_by_default`] is on.
    pub fn new_member(
        &self,
        name: impl Into<String>,
        peer_urls: Vec<String>,
        client_urls: Vec<String>,
        as_learner: bool,
        options: &MembershipOptions,
    ) -> Member {
        Member::with_random_id(
            name,
            peer_urls,
            client_urls,
            as_learner || options.learner_by_default,
            |id| self.is_taken(id),
        )
    }

    /// Refuses to run as `self_id` when it was removed (on start, and whenever a message
    /// from the cluster says so).
    pub fn check_not_removed(&self, self_id: u64) -> Result<(), MembershipError> {
        if self.is_removed(self_id) {
            Err(MembershipError::PermanentlyRemoved { id: self_id })
        } else {
            Ok(())
        }
    }

    /// Checks that the configuration a member was started with (`local`: name and peer URLs
    /// of every member) matches the cluster's, with etcd's errors.
    pub fn check_start_config(
        &self,
        local: &[(String, Vec<String>)],
    ) -> Result<(), MembershipError> {
        if local.len() != self.members.len() {
            return Err(MembershipError::MemberCountUnequal {
                local: local.len(),
                cluster: self.members.len(),
            });
        }
        let mut cluster: Vec<Vec<String>> = self
            .members
            .values()
            .map(|m| {
                let mut u = m.peer_urls.clone();
                u.sort();
                u
            })
            .collect();
        for (name, urls) in local {
            let mut u = urls.clone();
            u.sort();
            match cluster.iter().position(|c| *c == u) {
                Some(i) => {
                    cluster.swap_remove(i);
                }
                None => {
                    return Err(MembershipError::UnmatchedPeerUrls { name: name.clone() });
                }
            }
        }
        Ok(())
    }

    /// Validates adding `m` (etcd's order: removed id, existing id, peer URL in use, learner
    /// limit).
    pub fn validate_add(
        &self,
        m: &Member,
        options: &MembershipOptions,
    ) -> Result<(), MembershipError> {
        m.validate()?;
        if self.is_removed(m.id) {
            return Err(MembershipError::IdRemoved { id: m.id });
        }
        if self.members.contains_key(&m.id) {
            return Err(MembershipError::IdExists { id: m.id });
        }
        self.check_urls_free(m.id, &m.peer_urls)?;
        if m.is_learner && self.learners().len() >= options.max_learners {
            return Err(MembershipError::TooManyLearners {
                limit: options.max_learners,
            });
        }
        Ok(())
    }

    fn check_urls_free(&self, id: u64, urls: &[String]) -> Result<(), MembershipError> {
        for other in self.members.values().filter(|o| o.id != id) {
            if let Some(u) = urls.iter().find(|u| other.peer_urls.contains(u)) {
                return Err(MembershipError::PeerUrlExists { url: u.clone() });
            }
        }
        Ok(())
    }

    fn existing(&self, id: u64) -> Result<&Member, MembershipError> {
        if self.is_removed(id) {
            return Err(MembershipError::IdRemoved { id });
        }
        self.members
            .get(&id)
            .ok_or(MembershipError::MemberNotFound { id })
    }

    /// Validates `op` against the current members (not the strict check nor the promotion
    /// gate, which need the leader's view: see [`strict_check`](super::strict_check) and
    /// [`promotion_gate`](super::promotion_gate)).
    pub fn validate(
        &self,
        op: &MemberOp,
        options: &MembershipOptions,
    ) -> Result<Applied, MembershipError> {
        match op {
            MemberOp::Add(m) => self.validate_add(m, options).map(|()| Applied::Changed),
            MemberOp::Remove(id) => self.existing(*id).map(|_| Applied::Changed),
            MemberOp::UpdatePeerUrls { id, peer_urls } => {
                self.existing(*id)?;
                if peer_urls.is_empty() {
                    return Err(MembershipError::InvalidMember {
                        id: *id,
                        reason: "a member needs at least one peer URL".into(),
                    });
                }
                self.check_urls_free(*id, peer_urls)?;
                Ok(Applied::Changed)
            }
            MemberOp::Promote { id, automatic } => {
                let m = self.existing(*id)?;
                match (m.is_learner, automatic) {
                    (true, _) => Ok(Applied::Changed),
                    (false, true) => Ok(Applied::NoOp),
                    (false, false) => Err(MembershipError::NotLearner { id: *id }),
                }
            }
        }
    }

    /// Validates `op` again at apply time (a change committed on a stale view may have
    /// become invalid, as in etcd) and, when valid, stages its writes into `txn`, the
    /// transaction that also records the entry's consistent index. `index` is the entry's
    /// Raft index (recorded for removed ids). On error nothing is staged and the caller must
    /// skip the Raft conf change.
    pub fn apply<B: Backend>(
        &mut self,
        op: &MemberOp,
        index: u64,
        options: &MembershipOptions,
        txn: &mut WriteTxn<'_, B>,
    ) -> Result<Applied, MembershipError> {
        // Limits were enforced at proposal time; a committed add is never refused for them
        // (every member must reach the same verdict, whatever its options).
        let lenient = MembershipOptions {
            max_learners: usize::MAX,
            ..options.clone()
        };
        if self.validate(op, &lenient)? == Applied::NoOp {
            return Ok(Applied::NoOp);
        }
        let mut next = self.clone();
        match op {
            MemberOp::Add(m) => {
                next.members.insert(m.id, m.clone());
            }
            MemberOp::Remove(id) => {
                next.members.remove(id);
                next.held.remove(id);
                next.removed.insert(*id, index);
                txn.delete_aux(&MEMBERS_BUCKET, &id.to_be_bytes())
                    .map_err(store_err)?;
                txn.put_aux(&REMOVED_BUCKET, &id.to_be_bytes(), &removed_value(index))
                    .map_err(store_err)?;
            }
            MemberOp::UpdatePeerUrls { id, peer_urls } => {
                if let Some(m) = next.members.get_mut(id) {
                    m.peer_urls = peer_urls.clone();
                }
            }
            MemberOp::Promote { id, .. } => {
                // An explicit promotion (or an automatic one proposed before the hold, or by
                // a leader that does not know it) ends the hold with the learner.
                next.held.remove(id);
                if let Some(m) = next.members.get_mut(id) {
                    m.is_learner = false;
                }
            }
        }
        if let Some(m) = next.members.get(&op.id()) {
            txn.put_aux(&MEMBERS_BUCKET, &m.id.to_be_bytes(), &next.encode_listed(m))
                .map_err(store_err)?;
        }
        *self = next;
        Ok(Applied::Changed)
    }

    /// Records that member `m` joined the Raft configuration through a conf change that
    /// carried no membership operation (a raw one): it is listed as [`MemberOp::Add`] lists
    /// an added member, staged into `txn`, and, a learner, held from automatic promotion
    /// (see [`is_held`](Self::is_held)). The caller chooses its description and checks it
    /// with [`validate_add`](Self::validate_add) first. Returns whether anything changed:
    /// nothing when its id is already a member, or was removed (a removed id never becomes a
    /// member again, whatever the Raft configuration says).
    pub fn add_joined<B: Backend>(
        &mut self,
        m: Member,
        txn: &mut WriteTxn<'_, B>,
    ) -> Result<bool, MembershipError> {
        if self.is_taken(m.id) {
            return Ok(false);
        }
        let held = m.is_learner;
        self.put(m, held, txn)?;
        Ok(true)
    }

    /// Lists `m`, replacing what its id listed, held from automatic promotion when `held`
    /// (and a learner), staged into `txn`.
    fn put<B: Backend>(
        &mut self,
        m: Member,
        held: bool,
        txn: &mut WriteTxn<'_, B>,
    ) -> Result<(), MembershipError> {
        let held = held && m.is_learner;
        txn.put_aux(&MEMBERS_BUCKET, &m.id.to_be_bytes(), &m.encode_listed(held))
            .map_err(store_err)?;
        if held {
            self.held.insert(m.id);
        } else {
            self.held.remove(&m.id);
        }
        self.members.insert(m.id, m);
        Ok(())
    }

    /// Records that listed member `id` has the role `is_learner` in the Raft configuration
    /// after a conf change that carried no membership operation (a raw one): a learner
    /// promoted by it is listed as a voter, as [`MemberOp::Promote`] lists it (and is no
    /// longer held), and a voter demoted by it as a learner held from automatic promotion
    /// (see [`is_held`](Self::is_held)), staged into `txn`. Returns whether anything changed:
    /// nothing when `id` is not listed or is listed with that role already.
    pub fn set_role<B: Backend>(
        &mut self,
        id: u64,
        is_learner: bool,
        txn: &mut WriteTxn<'_, B>,
    ) -> Result<bool, MembershipError> {
        let Some(m) = self.members.get(&id).filter(|m| m.is_learner != is_learner) else {
            return Ok(false);
        };
        let m = Member {
            is_learner,
            ..m.clone()
        };
        self.put(m, is_learner, txn)?;
        Ok(true)
    }

    /// Records that member `id` left the Raft configuration at entry `index` through a conf
    /// change that carried no membership operation (a raw one): it is removed as
    /// [`MemberOp::Remove`] removes it, whether or not it was listed (a member added through
    /// a raw conf change is listed from then on, see [`add_joined`](Self::add_joined), but
    /// one added before it was not), staged into `txn`. Returns whether anything changed
    /// (nothing when `id` was removed before).
    pub fn remove_departed<B: Backend>(
        &mut self,
        id: u64,
        index: u64,
        txn: &mut WriteTxn<'_, B>,
    ) -> Result<bool, MembershipError> {
        if self.is_removed(id) {
            return Ok(false);
        }
        txn.delete_aux(&MEMBERS_BUCKET, &id.to_be_bytes())
            .map_err(store_err)?;
        txn.put_aux(&REMOVED_BUCKET, &id.to_be_bytes(), &removed_value(index))
            .map_err(store_err)?;
        self.members.remove(&id);
        self.held.remove(&id);
        self.removed.insert(id, index);
        Ok(true)
    }

    /// The membership after forcing a new cluster of member `id` alone (etcd's
    /// `--force-new-cluster`): every other member is recorded as removed at `index`; `id`
    /// stays (as a voter, so held by nothing), or `fallback` is used when it is not a member.
    pub fn forced_single(&self, id: u64, index: u64, fallback: Member) -> MemberSet {
        let mut next = MemberSet {
            members: BTreeMap::new(),
            held: BTreeSet::new(),
            removed: self.removed.clone(),
        };
        for (&other, _) in self.members.iter().filter(|(o, _)| **o != id) {
            next.removed.insert(other, index);
        }
        let mut me = self.members.get(&id).cloned().unwrap_or(fallback);
        me.is_learner = false;
        next.members.insert(id, me);
        next
    }

    /// Records that member `self_id` published its name and client URLs on start (etcd's
    /// publish), staged into `txn`.
    pub fn publish<B: Backend>(
        &mut self,
        id: u64,
        name: &str,
        client_urls: Vec<String>,
        txn: &mut WriteTxn<'_, B>,
    ) -> Result<(), MembershipError> {
        let mut m = self.existing(id)?.clone();
        m.name = name.to_owned();
        m.client_urls = client_urls;
        m.validate()?;
        let held = self.is_held(id);
        self.put(m, held, txn)
    }
}

fn removed_value(index: u64) -> Vec<u8> {
    let mut v = vec![MEMBER_FORMAT];
    v.extend_from_slice(&index.to_le_bytes());
    v
}

#[cfg(test)]
mod tests {
    use super::*;
    use keel_mvcc::StoreOptions;
    use keel_mvcc::testing::MemBackend;

    fn member(id: u64, learner: bool) -> Member {
        Member {
            id,
            name: format!("m{id}"),
            peer_urls: vec![format!("http://10.0.1.{id}:2380")],
            client_urls: vec![format!("http://10.0.1.{id}:2379")],
            is_learner: learner,
        }
    }

    fn three() -> MemberSet {
        MemberSet::bootstrap(vec![member(1, false), member(2, false), member(3, false)])
            .expect("bootstrap")
    }

    fn store(dir: &std::path::Path) -> Store<MemBackend> {
        let b = <MemBackend as Backend>::open(&dir.join("b"), &Default::default()).expect("open");
        Store::open(b, StoreOptions::default()).expect("store")
    }

    /// [`three`], persisted in a fresh store (kept as long as the directory).
    fn persisted_three() -> (tempfile::TempDir, Store<MemBackend>, MemberSet) {
        let set = three();
        let dir = tempfile::tempdir().expect("tempdir");
        let st = store(dir.path());
        let mut txn = st.write();
        set.persist_all(&mut txn).expect("persist");
        txn.commit().expect("commit");
        (dir, st, set)
    }

    #[test]
    fn add_errors_follow_etcd() {
        let opts = MembershipOptions::default();
        let (_dir, st, mut set) = persisted_three();
        // peerURL exists
        let mut dup = member(9, false);
        dup.peer_urls = vec!["http://10.0.1.2:2380".into()];
        assert_eq!(
            set.validate(&MemberOp::Add(dup), &opts),
            Err(MembershipError::PeerUrlExists {
                url: "http://10.0.1.2:2380".into()
            })
        );
        // existing id
        assert_eq!(
            set.validate(&MemberOp::Add(member(2, false)), &opts),
            Err(MembershipError::IdExists { id: 2 })
        );
        // one learner is fine, a second is too many (etcd v3.4)
        let mut txn = st.write();
        assert_eq!(
            set.apply(&MemberOp::Add(member(4, true)), 10, &opts, &mut txn),
            Ok(Applied::Changed)
        );
        txn.commit().expect("commit");
        assert_eq!(
            set.validate(&MemberOp::Add(member(5, true)), &opts),
            Err(MembershipError::TooManyLearners { limit: 1 })
        );
        // removed ids are never reused
        let mut txn = st.write();
        set.apply(&MemberOp::Remove(4), 11, &opts, &mut txn)
            .expect("remove");
        txn.commit().expect("commit");
        assert_eq!(
            set.validate(&MemberOp::Add(member(4, false)), &opts),
            Err(MembershipError::IdRemoved { id: 4 })
        );
        assert_eq!(
            set.validate(&MemberOp::Remove(4), &opts),
            Err(MembershipError::IdRemoved { id: 4 })
        );
        assert_eq!(
            set.check_not_removed(4),
            Err(MembershipError::PermanentlyRemoved { id: 4 })
        );
        assert_eq!(set.check_not_removed(1), Ok(()));
        // and the removal survives a reload
        let loaded = MemberSet::load(&st).expect("load");
        assert_eq!(loaded, set);
        assert!(loaded.is_removed(4));
    }

    #[test]
    fn promote_errors_follow_etcd() {
        let opts = MembershipOptions::default();
        let (_dir, st, mut set) = persisted_three();
        assert_eq!(
            set.validate(
                &MemberOp::Promote {
                    id: 0x12345abcde,
                    automatic: false
                },
                &opts
            ),
            Err(MembershipError::MemberNotFound { id: 0x12345abcde })
        );
        assert_eq!(
            set.validate(
                &MemberOp::Promote {
                    id: 1,
                    automatic: false
                },
                &opts
            ),
            Err(MembershipError::NotLearner { id: 1 })
        );
        let mut txn = st.write();
        set.apply(&MemberOp::Add(member(4, true)), 5, &opts, &mut txn)
            .expect("add");
        assert_eq!(
            set.apply(
                &MemberOp::Promote {
                    id: 4,
                    automatic: false
                },
                6,
                &opts,
                &mut txn
            ),
            Ok(Applied::Changed)
        );
        txn.commit().expect("commit");
        assert!(set.voters().contains(&4));
        // an automatic promote racing the manual one is a no-op; a manual one is an error
        let mut txn = st.write();
        assert_eq!(
            set.apply(
                &MemberOp::Promote {
                    id: 4,
                    automatic: true
                },
                7,
                &opts,
                &mut txn
            ),
            Ok(Applied::NoOp)
        );
        assert_eq!(
            set.apply(
                &MemberOp::Promote {
                    id: 4,
                    automatic: false
                },
                7,
                &opts,
                &mut txn
            ),
            Err(MembershipError::NotLearner { id: 4 })
        );
        drop(txn);
        assert_eq!(MemberSet::load(&st).expect("load"), set);
    }

    #[test]
    fn update_and_remove_validate_and_persist() {
        let opts = MembershipOptions::default();
        let (_dir, st, mut set) = persisted_three();
        assert_eq!(
            set.validate(&MemberOp::Remove(77), &opts),
            Err(MembershipError::MemberNotFound { id: 77 })
        );
        assert_eq!(
            set.validate(
                &MemberOp::UpdatePeerUrls {
                    id: 1,
                    peer_urls: vec!["http://10.0.1.3:2380".into()]
                },
                &opts
            ),
            Err(MembershipError::PeerUrlExists {
                url: "http://10.0.1.3:2380".into()
            })
        );
        let mut txn = st.write();
        let up = MemberOp::UpdatePeerUrls {
            id: 1,
            peer_urls: vec!["http://10.0.1.10:2380".into()],
        };
        set.apply(&up, 3, &opts, &mut txn).expect("update");
        txn.commit().expect("commit");
        let loaded = MemberSet::load(&st).expect("load");
        assert_eq!(
            loaded.get(1).map(|m| m.peer_urls.clone()),
            Some(vec!["http://10.0.1.10:2380".to_string()])
        );
        assert_eq!(loaded, set);
    }

    #[test]
    fn start_configuration_must_match() {
        let set = three();
        let local = |ids: &[u64]| -> Vec<(String, Vec<String>)> {
            ids.iter()
                .map(|i| (format!("m{i}"), vec![format!("http://10.0.1.{i}:2380")]))
                .collect()
        };
        assert_eq!(set.check_start_config(&local(&[1, 2, 3])), Ok(()));
        assert_eq!(
            set.check_start_config(&local(&[1, 2])),
            Err(MembershipError::MemberCountUnequal {
                local: 2,
                cluster: 3
            })
        );
        assert_eq!(
            set.check_start_config(&local(&[1, 2, 4])),
            Err(MembershipError::UnmatchedPeerUrls { name: "m4".into() })
        );
    }

    #[test]
    fn learner_by_default_makes_adds_learners() {
        let set = three();
        let opts = MembershipOptions::default();
        let m = set.new_member("n", vec!["http://x:1".into()], vec![], false, &opts);
        assert!(m.is_learner);
        assert!(!set.is_taken(m.id));
        let opts = MembershipOptions {
            learner_by_default: false,
            ..opts
        };
        let m = set.new_member("n", vec!["http://x:1".into()], vec![], false, &opts);
        assert!(!m.is_learner);
    }

    /// A learner added or demoted by a raw conf change is held from automatic promotion
    /// until it stops being a learner; the holds are stored with the members (read back by
    /// a reload, as after a restart or a snapshot), and a store of version 1 records only
    /// holds none.
    #[test]
    fn holds_follow_raw_roles_and_are_stored() {
        let opts = MembershipOptions::default();
        let (_dir, st, mut set) = persisted_three();
        assert!(
            MemberSet::load(&st)
                .expect("load")
                .held_learners()
                .is_empty()
        );

        let mut txn = st.write();
        assert!(set.add_joined(member(4, true), &mut txn).expect("join"));
        assert!(set.add_joined(member(6, false), &mut txn).expect("join"));
        assert!(set.set_role(3, true, &mut txn).expect("demote"));
        set.apply(&MemberOp::Add(member(5, true)), 10, &opts, &mut txn)
            .expect("add");
        set.publish(3, "renamed", Vec::new(), &mut txn)
            .expect("publish");
        txn.commit().expect("commit");
        assert_eq!(set.held_learners(), BTreeSet::from([3, 4]));
        assert!(!set.is_held(5), "added by a membership operation");
        assert!(!set.is_held(6), "joined as a voter");
        let loaded = MemberSet::load(&st).expect("load");
        assert_eq!(loaded, set);
        assert_eq!(loaded.held_learners(), BTreeSet::from([3, 4]));
        let (m3, held) = Member::decode_listed(
            &st.aux_get(&MEMBERS_BUCKET, &3u64.to_be_bytes())
                .expect("get")
                .expect("listed"),
        )
        .expect("decode");
        assert!(held && m3.is_learner && m3.name == "renamed", "{m3:?}");

        // Promoted by a raw conf change, by a membership operation, or removed: no hold.
        let mut txn = st.write();
        assert!(set.set_role(4, false, &mut txn).expect("raw promote"));
        set.apply(
            &MemberOp::Promote {
                id: 3,
                automatic: false,
            },
            11,
            &opts,
            &mut txn,
        )
        .expect("promote");
        assert!(set.set_role(2, true, &mut txn).expect("demote"));
        assert!(set.remove_departed(2, 12, &mut txn).expect("depart"));
        txn.commit().expect("commit");
        assert!(set.held_learners().is_empty(), "{:?}", set.held_learners());
        assert_eq!(MemberSet::load(&st).expect("load"), set);

        let mut txn = st.write();
        set.set_role(1, true, &mut txn).expect("demote");
        txn.commit().expect("commit");
        assert!(set.is_held(1));
        let forced = set.forced_single(1, 13, member(1, false));
        assert!(forced.held_learners().is_empty());
        assert_eq!(forced.voters(), BTreeSet::from([1]));
    }

    #[test]
    fn corrupt_stored_members_are_reported() {
        let dir = tempfile::tempdir().expect("tempdir");
        let st = store(dir.path());
        let mut txn = st.write();
        let mut bytes = member(1, false).encode();
        bytes[5] ^= 1;
        txn.put_aux(&MEMBERS_BUCKET, &1u64.to_be_bytes(), &bytes)
            .expect("put");
        txn.commit().expect("commit");
        assert!(matches!(
            MemberSet::load(&st),
            Err(MembershipError::Decode { .. })
        ));
    }
}
