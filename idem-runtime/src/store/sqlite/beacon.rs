//! What the processes on one SQLite file tell each other of the time its lock was not free.
//!
//! A claim gives leases back the time the file was dark ([`give_time_back`]), but a process
//! knows only its own waits. A duplicate in another process that began to wait late in a
//! long freeze, or came just after it, saw little of it, and took over a lease that ran out
//! while its live holder, in a third process, was waiting for the lock to renew it: the
//! body ran twice. So a process that has waited [`REPORT_AFTER`] for the lock says so in a
//! file beside the database, `<file>-idem-dark`: since when it waits, and when it last
//! looked, written again every [`REFRESH`] while it waits. A claim reads it before it
//! decides whether leases are owed time back, and counts the dark time a waiter noted as
//! its own while the note is current ([`Beacon::dark_since`]).
//!
//! The note is replaced whole (written beside and renamed over), so a reader never sees half
//! of one; it holds two timestamps, nothing of any key. Nothing in it needs to outlive the
//! processes: a note stops counting once nobody renews it, and a file that cannot be written
//! (a read-only directory) leaves each process with its own waits, as before, with a warning
//! in the log.
//!
//! [`give_time_back`]: super::writes

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::time::Instant;

/// How long a process waits for the file's lock before it notes the wait: well under the
/// shortest wait taken as a lockout ([`LOCKED_OUT_FLOOR`](super::LOCKED_OUT_FLOOR)), so
/// that a claim in another process sees a lockout before it is one.
pub(super) const REPORT_AFTER: Duration = Duration::from_millis(30);

/// How often a process that goes on waiting writes its note again.
const REFRESH: Duration = Duration::from_millis(25);

/// How long a note counts after its writer last looked, for a claim of `lease`: half the
/// lease, and a second at least. A holder whose renewal gave up at its store's timeout tries
/// again at its next renewal, a quarter of a lease later; its note must last until then, or
/// a claim in that gap would find the lease run out and no lockout noted. A note that
/// counts too long costs only time given back once to a lease that ran out meanwhile.
fn fresh(lease: Duration) -> Duration {
    (lease / 2).max(Duration::from_secs(1))
}

/// One process's side of the note beside a file.
pub(super) struct Beacon {
    /// `<file>-idem-dark`; `None` for a database with no file.
    path: Option<PathBuf>,
    /// Where a note is written before it is renamed over `path`: one of this beacon's own.
    draft: PathBuf,
    /// When this beacon last wrote its note.
    written: Mutex<Option<Instant>>,
    /// Whether a failure to write the note was logged already.
    warned: AtomicBool,
}

impl Beacon {
    /// The beacon of the database at `file` (none for an in-memory one).
    pub(super) fn beside(file: &Path) -> Self {
        static DRAFTS: AtomicU64 = AtomicU64::new(0);
        let text = file.to_string_lossy();
        let path = (!text.is_empty() && !super::in_memory(file)).then(|| {
            let mut name = file.as_os_str().to_os_string();
            name.push("-idem-dark");
            PathBuf::from(name)
        });
        let mut draft = path.clone().unwrap_or_default().into_os_string();
        draft.push(format!(
            ".{}.{}",
            std::process::id(),
            DRAFTS.fetch_add(1, Ordering::Relaxed)
        ));
        Self {
            path,
            draft: PathBuf::from(draft),
            written: Mutex::default(),
            warned: AtomicBool::new(false),
        }
    }

    /// Notes that this process has found the file's lock held, without getting it, since
    /// `since`: written once the wait is [`REPORT_AFTER`] long, and every [`REFRESH`] then.
    pub(super) fn waiting(&self, since: Instant) {
        let Some(path) = &self.path else { return };
        if since.elapsed() < REPORT_AFTER {
            return;
        }
        let mut written = self.written.lock().unwrap_or_else(PoisonError::into_inner);
        if written.is_some_and(|at| at.elapsed() < REFRESH) {
            return;
        }
        *written = Some(Instant::now());
        let now = unix_ms(SystemTime::now());
        let note = format!("{} {now}\n", now.saturating_sub(as_ms(since.elapsed())));
        let wrote =
            std::fs::write(&self.draft, note).and_then(|()| std::fs::rename(&self.draft, path));
        if let Err(err) = wrote {
            if !self.warned.swap(true, Ordering::Relaxed) {
                tracing::warn!(
                    note = %path.display(),
                    error = %err,
                    "cannot tell the other processes on this SQLite file that its lock is held: each counts only its own waits when it gives leases time back"
                );
            }
        }
    }

    /// Since when the file has been dark to a process that noted it within what counts for
    /// a claim of `lease` ([`fresh`]), if one did.
    pub(super) fn dark_since(&self, lease: Duration) -> Option<Instant> {
        let text = std::fs::read_to_string(self.path.as_ref()?).ok()?;
        let (since, seen) = text.trim().split_once(' ')?;
        let (since, seen) = (since.parse::<u64>().ok()?, seen.parse::<u64>().ok()?);
        let now = unix_ms(SystemTime::now());
        if now.saturating_sub(seen) > as_ms(fresh(lease)) || since > now {
            return None;
        }
        Instant::now().checked_sub(Duration::from_millis(now - since))
    }
}

fn unix_ms(at: SystemTime) -> u64 {
    at.duration_since(UNIX_EPOCH).map_or(0, as_ms)
}

fn as_ms(span: Duration) -> u64 {
    u64::try_from(span.as_millis()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(test: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("idem-beacon-{}-{test}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir.join("idem.db")
    }

    #[test]
    fn a_wait_noted_by_one_process_is_read_by_another() {
        let path = file("noted");
        let (waiter, reader) = (Beacon::beside(&path), Beacon::beside(&path));
        let lease = Duration::from_secs(2);
        assert!(reader.dark_since(lease).is_none(), "nothing noted yet");

        let since = Instant::now() - Duration::from_millis(700);
        waiter.waiting(since);
        let read = reader.dark_since(lease).expect("the wait is noted");
        let off = if read > since {
            read - since
        } else {
            since - read
        };
        assert!(off < Duration::from_millis(50), "read {off:?} off");
    }

    #[test]
    fn a_short_wait_is_not_noted() {
        let path = file("short");
        let (waiter, reader) = (Beacon::beside(&path), Beacon::beside(&path));
        waiter.waiting(Instant::now());
        assert!(reader.dark_since(Duration::from_secs(2)).is_none());
    }

    #[test]
    fn a_note_nobody_renews_stops_counting() {
        let path = file("stale");
        let seen = unix_ms(SystemTime::now()) - 5_000;
        std::fs::write(
            format!("{}-idem-dark", path.display()),
            format!("{} {seen}", seen - 1_000),
        )
        .unwrap();
        let reader = Beacon::beside(&path);
        assert!(
            reader.dark_since(Duration::from_secs(2)).is_none(),
            "5 s old, 1 s counts"
        );
        assert!(
            reader.dark_since(Duration::from_secs(20)).is_some(),
            "10 s count"
        );
    }

    #[test]
    fn a_note_that_cannot_be_written_is_warned_of_once_and_read_as_none() {
        let path = file("unwritable").join("no-such-directory").join("idem.db");
        let beacon = Beacon::beside(&path);
        beacon.waiting(Instant::now() - Duration::from_secs(1));
        assert!(
            beacon.warned.load(Ordering::Relaxed),
            "the failure is logged"
        );
        assert!(beacon.dark_since(Duration::from_secs(2)).is_none());
    }

    #[test]
    fn a_database_in_memory_has_no_note() {
        let beacon = Beacon::beside(Path::new(":memory:"));
        beacon.waiting(Instant::now() - Duration::from_secs(1));
        assert!(beacon.dark_since(Duration::from_secs(2)).is_none());
    }
}
