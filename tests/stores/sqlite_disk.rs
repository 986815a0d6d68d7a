//! `SqliteStore` on a disk that fills: a claim that cannot be committed fails closed and its
//! body never runs; a result whose record cannot be written answers its caller
//! `Unrecorded`, and once the disk drains, the key replays it instead of running again.
//!
//! Each test fills a small filesystem of its own (a `tmpfs` mounted for it, which needs
//! root); where it cannot be mounted the test is skipped loudly, or fails when
//! `IDEM_REQUIRE_SERVICES=1` (CI).

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use idem_runtime::{Error, Operation, Outcome, SqliteStore};
use idem_tests::scenarios::namespace;
use idem_tests::{unavailable, Runs};

/// A filesystem of 4 MiB of the test's own, unmounted when dropped.
struct SmallDisk(PathBuf);

impl SmallDisk {
    fn mount(test: &str) -> Option<Self> {
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("small-disk-{test}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mounted = Command::new("mount")
            .args(["-t", "tmpfs", "-o", "size=4m", "tmpfs"])
            .arg(&dir)
            .output();
        match mounted {
            Ok(out) if out.status.success() => Some(Self(dir)),
            Ok(out) => unavailable(
                "a tmpfs of the test's own (`mount -t tmpfs`, as root)",
                String::from_utf8_lossy(&out.stderr).trim(),
            ),
            Err(err) => unavailable("`mount`", err),
        }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }

    /// Fills what is left of the disk with a file of its own.
    fn fill(&self) -> Filler {
        let path = self.path("filler");
        let mut file = File::create(&path).unwrap();
        let chunk = [0_u8; 512];
        while file.write_all(&chunk).is_ok() {}
        let _ = file.sync_all();
        Filler(path)
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
        let _ = std::fs::remove_dir(&self.0);
    }
}

/// The file that fills the disk: removing it drains the disk.
struct Filler(PathBuf);

impl Filler {
    fn drain(self) {
        std::fs::remove_file(&self.0).unwrap();
    }
}

async fn open(path: &Path) -> SqliteStore {
    let store = SqliteStore::open(path)
        .await
        .unwrap()
        .with_timeout(Duration::from_secs(2));
    store.migrate().await.unwrap();
    store
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_on_a_full_disk_fails_closed_and_its_body_never_runs() {
    let Some(disk) = SmallDisk::mount("claim") else {
        return;
    };
    let store = open(&disk.path("idem.db")).await;
    let op = Operation::new(namespace("sqlite.full-disk-claim"));
    let runs = Runs::default();
    let filler = disk.fill();
    for n in 0..4 {
        let ran = op
            .run(&store, &op.key(&n).unwrap(), None, async {
                runs.hit();
                Ok::<_, Error>(n)
            })
            .await;
        // The take commits by itself; its commit failing must fail the claim.
        assert!(matches!(ran, Err(Error::Store(_))), "{ran:?}");
    }
    assert_eq!(runs.count(), 0, "no body ran unclaimed");
    filler.drain();
    let ran = op
        .run(&store, &op.key(&0).unwrap(), None, async {
            runs.hit();
            Ok::<_, Error>(0)
        })
        .await;
    assert_eq!(ran.unwrap(), Outcome::Executed(0));
    assert_eq!(runs.count(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_disk_that_fills_while_the_body_runs_leaves_the_key_replaying_once_it_drains() {
    let Some(disk) = SmallDisk::mount("record") else {
        return;
    };
    let file = disk.path("idem.db");
    let store = open(&file).await;
    let op = Operation::new(namespace("sqlite.full-disk-record"))
        .lease(Duration::from_secs(1))
        .wait(Duration::from_secs(30));
    let key = op.key(&1).unwrap();
    let runs = Runs::default();
    let mut filler = None;
    // A value larger than what is left of the write-ahead log's pages.
    let value = "x".repeat(200_000);
    let first = op
        .run(&store, &key, None, async {
            runs.hit();
            filler = Some(disk.fill());
            Ok::<_, Error>(value.clone())
        })
        .await;
    assert!(matches!(first, Err(Error::Unrecorded(_))), "{first:?}");

    // The disk drains; this process still holds the result, and records it: a retry here
    // waits for that and replays it, and so does another process after it.
    filler.take().unwrap().drain();
    let retry = |store: SqliteStore| {
        let (op, runs) = (op.clone(), runs.clone());
        async move {
            op.run(&store, &key, None, async {
                runs.hit();
                Ok::<_, Error>(String::new())
            })
            .await
            .unwrap()
        }
    };
    assert_eq!(retry(store).await, Outcome::Replayed(value.clone()));
    let elsewhere = open(&file).await;
    assert_eq!(retry(elsewhere).await, Outcome::Replayed(value));
    assert_eq!(runs.count(), 1, "the body ran once");
}
