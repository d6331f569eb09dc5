//! `LmdbOptions::write_map`: the backend passes the conformance suite writing through the
//! map; the data file is sparse at the map size while the reported on-disk size counts what
//! is allocated; a full map is still a clear error that `grow_map` lifts; and a store moves
//! between the two modes across reopens with its contents.

use keel_backend_lmdb::{LmdbBackend, LmdbOptions};
use keel_mvcc::{Backend, BackendError, Bucket, WriteBatch};

use crate::common::{data_file, dump_backend, open};

const KV: Bucket = Bucket::new("kv");

mod conformance {
    use super::*;

    keel_mvcc::backend_conformance_tests!(
        LmdbBackend,
        LmdbOptions {
            write_map: true,
            ..LmdbOptions::default()
        }
    );
}

fn options(map_size: u64, write_map: bool) -> LmdbOptions {
    LmdbOptions {
        map_size,
        write_map,
        ..LmdbOptions::default()
    }
}

fn batch(from: u32, n: u32, value_len: usize) -> WriteBatch {
    let mut b = WriteBatch::new();
    for i in from..from + n {
        b.put(&KV, format!("k{i:06}"), vec![i as u8; value_len]);
    }
    b
}

#[test]
fn the_data_file_is_sparse_and_the_reported_size_counts_allocated_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("store");
    let map = 256u64 << 20;
    let backend = open(&path, &options(map, true));
    backend.commit(&batch(0, 1000, 1000)).expect("commit");
    let len = std::fs::metadata(data_file(&path)).unwrap().len();
    assert_eq!(len, map, "write_map extends the data file to the map size");
    let size = backend.size().expect("size");
    assert!(
        size.on_disk >= size.in_use && size.on_disk < map / 16,
        "on disk {} bytes, in use {} bytes, map {map}",
        size.on_disk,
        size.in_use
    );
    assert!(size.in_use >= 1000 * 1000, "in use {} bytes", size.in_use);
}

#[test]
fn a_full_map_is_reported_and_grown_while_writing_through_the_map() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("store");
    let backend = open(&path, &options(1 << 20, true));
    let mut fitted = 0;
    let failed = loop {
        let b = batch(fitted * 4, 4, 32 << 10);
        match backend.commit(&b) {
            Ok(()) => fitted += 1,
            Err(BackendError::Full { limit, .. }) => {
                assert_eq!(limit, 1 << 20);
                break b;
            }
            Err(e) => panic!("commit failed with {e:?} instead of Full"),
        }
        assert!(fitted < 1000, "a 1 MiB map never filled up");
    };
    assert!(fitted > 0);
    let before = dump_backend(&backend);
    assert!(matches!(
        backend.commit(&failed),
        Err(BackendError::Full { .. })
    ));
    assert_eq!(
        dump_backend(&backend),
        before,
        "a failed batch left changes"
    );
    backend.grow_map(8 << 20).expect("grow");
    backend
        .commit(&failed)
        .expect("the batch fits after growing");
    assert_eq!(dump_backend(&backend)["kv"].len(), before["kv"].len() + 4);
}

#[test]
fn a_store_reopens_across_modes_with_its_contents() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("store");
    let map = 64u64 << 20;
    let mut expect = None;
    for (round, write_map) in [false, true, false, true].into_iter().enumerate() {
        let backend = open(&path, &options(map, write_map));
        if let Some(expect) = &expect {
            assert_eq!(&dump_backend(&backend), expect, "round {round}");
        }
        backend
            .commit(&batch(round as u32 * 500, 500, 300))
            .expect("commit");
        expect = Some(dump_backend(&backend));
        drop(backend);
    }
    let backend: LmdbBackend = open(&path, &options(map, false));
    assert_eq!(Some(dump_backend(&backend)), expect);
    assert_eq!(dump_backend(&backend)["kv"].len(), 2000);
}
