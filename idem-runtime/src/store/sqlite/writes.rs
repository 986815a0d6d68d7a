//! The writes of one [`SqliteStore`](super::SqliteStore): every write of the process waiting
//! for the file's lock commits in one transaction on the store's own connection.
//!
//! SQLite's lock is not a queue. A connection that finds it taken sleeps, longer each time
//! (up to 100 ms), and looks again; whoever looks at the right moment wins. With one
//! connection per waiting write, a renewal could lose that lottery for longer than a lease
//! while the crowd's writes went through, and its holder's key was taken over. Here a
//! process is one contender: writes queue in the process, the first to find no transaction
//! running takes every write queued and commits them together, and the next transaction
//! takes the ones that came meanwhile. A renewal then waits for at most one transaction of
//! its own process, and a crowd costs one commit per turn instead of one per call.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use sqlx::pool::PoolConnection;
use sqlx::sqlite::{SqlitePool, SqliteRow};
use sqlx::{Connection, Sqlite, SqliteConnection};
use tokio::sync::oneshot;
use tokio::time::Instant;

use super::{locked_out, lockout, Statements, LOCKED_OUT_FLOOR};
use crate::store::sql::millis;
use crate::{Fingerprint, Key, Token};

/// How much longer than what is left of its deadline a write's busy handler may wait, in
/// milliseconds: the write's caller is answered at the deadline regardless, and the next
/// transaction waits at most this much longer for the connection.
const BUSY_SLACK: u128 = 50;

/// A write's answer: where it goes, and what the write did until the commit sends it.
pub(super) struct Answer<T> {
    to: oneshot::Sender<Result<T, sqlx::Error>>,
    done: Option<T>,
}

/// Where a caller waits for its write's answer.
pub(super) type Answered<T> = oneshot::Receiver<Result<T, sqlx::Error>>;

impl<T> Answer<T> {
    /// An answer, and where to wait for it.
    fn new() -> (Self, Answered<T>) {
        let (to, answered) = oneshot::channel();
        (Self { to, done: None }, answered)
    }

    /// Sends what the write did, or the error that stopped it.
    fn send(self, result: Result<(), sqlx::Error>) {
        let _ = match (result, self.done) {
            (Ok(()), Some(done)) => self.to.send(Ok(done)),
            (Ok(()), None) => Ok(()), // left out: its caller stopped waiting
            (Err(err), _) => self.to.send(Err(err)),
        };
    }
}

/// One queued write, with its statements, how long its caller waits, and its answer.
struct Write {
    job: Job,
    sql: Arc<Statements>,
    deadline: Instant,
}

pub(super) enum Job {
    /// Takes `key` unless a live row of another caller holds it: the token, or that row.
    Take {
        key: Key,
        fingerprint: Option<Fingerprint>,
        lease: Duration,
        nonce: u64,
        /// When the claim began: a claim that waited long gives leases time back.
        started: Instant,
        answer: Answer<Result<Token, SqliteRow>>,
    },
    /// A holder's statement (completion, release, renewal), which finds its row by its
    /// token: whether it did.
    Fenced {
        statement: Fence,
        key: Key,
        token: Token,
        value: Option<Bytes>,
        millis: Option<i64>,
        answer: Answer<bool>,
    },
    /// Deletes `key`'s row, whatever it holds: whether one was deleted, and was live.
    Remove {
        key: Key,
        answer: Answer<Option<bool>>,
    },
}

/// The statement of a holder's write.
#[derive(Clone, Copy)]
pub(super) enum Fence {
    Complete,
    Release,
    Renew,
    /// The record of the step with this key.
    RecordStep(Key),
}

/// The write queue of one store and its clones.
pub(super) struct Writes {
    /// One connection: writes take turns here rather than on the file's lock.
    conn: SqlitePool,
    queue: Mutex<Vec<Write>>,
    /// Held while a transaction of queued writes runs, so that one runs at a time.
    turn: Arc<tokio::sync::Mutex<()>>,
    /// The busy timeout last set on the connection, in milliseconds, and the connection it
    /// was set on (the count of connections `conn` has opened then; see [`Writes::new`]).
    busy: Mutex<Option<(u64, u128)>>,
    opened: Arc<AtomicU64>,
    /// The file's write-ahead log, whose modification time is the last commit any process
    /// made (`None` for a database in memory).
    wal: Option<std::path::PathBuf>,
    /// When a write here last found the file's lock held ([`LOCKED_OUT_FLOOR`] or more of
    /// waiting, or a wait given up): the evidence that a file without commits was locked
    /// out, not idle.
    lock_seen: Mutex<Option<Instant>>,
}

impl Writes {
    /// The queue of writes on `conn`, whose `opened` counts the connections it opens.
    pub(super) fn new(conn: SqlitePool, opened: Arc<AtomicU64>) -> Self {
        let file = conn.connect_options().get_filename().to_path_buf();
        let wal = (!file.as_os_str().is_empty() && file != std::path::Path::new(":memory:"))
            .then(|| std::path::PathBuf::from(format!("{}-wal", file.display())));
        Self {
            conn,
            queue: Mutex::default(),
            turn: Arc::default(),
            busy: Mutex::default(),
            opened,
            wal,
            lock_seen: Mutex::default(),
        }
    }

    /// Notes that a write here waited `waited` for the file's lock (or gave up on it).
    fn waited(&self, waited: Duration) {
        if waited >= LOCKED_OUT_FLOOR {
            *self
                .lock_seen
                .lock()
                .unwrap_or_else(PoisonError::into_inner) = Some(Instant::now());
        }
    }

    /// When the file last had a commit, if it was locked out since, as far as this process
    /// can tell: a write here found the lock held after that commit (an idle file is not a
    /// locked one). A process that never found the lock held reads no file metadata.
    fn locked_out_since(&self) -> Option<SystemTime> {
        let seen = (*self
            .lock_seen
            .lock()
            .unwrap_or_else(PoisonError::into_inner))?;
        let last = self.last_commit();
        let since = SystemTime::now().duration_since(last).unwrap_or_default();
        (seen.elapsed() <= since).then_some(last)
    }

    /// How long the file went without a commit while locked out ([`locked_out_since`](Self::locked_out_since)).
    fn dark(&self) -> Duration {
        self.locked_out_since()
            .and_then(|last| SystemTime::now().duration_since(last).ok())
            .unwrap_or_default()
    }

    /// When any process last committed to the file, by the write-ahead log's modification
    /// time: now when it cannot be read (a database in memory, a log not yet written).
    fn last_commit(&self) -> SystemTime {
        self.wal
            .as_ref()
            .and_then(|wal| std::fs::metadata(wal).ok()?.modified().ok())
            .unwrap_or_else(SystemTime::now)
    }

    /// The store's connection, whose busy handler waits for the file's lock at most until
    /// `deadline` (give or take [`BUSY_SLACK`]): the busy timeout is set only when what is
    /// left differs from what was set, which for writes that do not wait is never.
    async fn writer(&self, deadline: Instant) -> Result<PoolConnection<Sqlite>, sqlx::Error> {
        let mut conn = self.conn.acquire().await?;
        let left = deadline
            .saturating_duration_since(Instant::now())
            .as_millis()
            .clamp(1, i32::MAX as u128 - BUSY_SLACK);
        let connection = self.opened.load(Ordering::Acquire);
        let set = *self.busy.lock().unwrap_or_else(PoisonError::into_inner);
        let current = matches!(set, Some((on, busy)) if on == connection && busy >= left && busy - left <= BUSY_SLACK);
        if !current {
            // Half the slack above what is left, so that the next call's fresh deadline,
            // a little later than this one's, finds it current too.
            let busy = left + BUSY_SLACK / 2;
            sqlx::query(&format!("PRAGMA busy_timeout = {busy}"))
                .persistent(false)
                .execute(&mut *conn)
                .await?;
            *self.busy.lock().unwrap_or_else(PoisonError::into_inner) = Some((connection, busy));
        }
        Ok(conn)
    }

    /// Queues `job` for the next transaction of queued writes, and waits for its answer.
    ///
    /// A caller with the turn finds no transaction running: its own write is either still
    /// queued, and it starts a transaction of every write queued, or was in one that ended.
    pub(super) async fn run<T>(
        self: &Arc<Self>,
        sql: &Arc<Statements>,
        (job, answered): (Job, Answered<T>),
        deadline: Instant,
    ) -> Result<T, sqlx::Error> {
        self.queue().push(Write {
            job,
            sql: Arc::clone(sql),
            deadline,
        });
        let turn = Arc::clone(&self.turn).lock_owned().await;
        let batch = std::mem::take(&mut *self.queue());
        if !batch.is_empty() {
            // Spawned, so that a caller that stops waiting does not stop the others' writes.
            let writes = Arc::clone(self);
            tokio::spawn(async move {
                writes.commit(batch).await;
                drop(turn);
            });
        }
        answered.await.unwrap_or(Err(sqlx::Error::WorkerCrashed))
    }

    fn queue(&self) -> std::sync::MutexGuard<'_, Vec<Write>> {
        self.queue.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Commits `batch` in one transaction and answers each write; if that fails, each
    /// write runs again alone, so that one bad write fails only its own caller.
    async fn commit(&self, mut batch: Vec<Write>) {
        match self.transaction(&mut batch).await {
            Err(_) if batch.len() > 1 => {
                for mut write in batch {
                    let result = self.transaction(std::slice::from_mut(&mut write)).await;
                    write.job.answer(result);
                }
            }
            Err(err) => {
                if let Some(write) = batch.pop() {
                    write.job.answer(Err(err)); // the only one
                }
            }
            Ok(()) => batch.into_iter().for_each(|write| write.job.answer(Ok(()))),
        }
    }

    /// Runs `batch` in one `BEGIN IMMEDIATE` transaction, which holds the file's write lock
    /// from its first statement, or a lone write by itself (see below). The busy handler
    /// waits as long as the most patient caller. A write whose caller stopped waiting is left
    /// out: a claim nobody waits for is not taken.
    async fn transaction(&self, batch: &mut [Write]) -> Result<(), sqlx::Error> {
        let deadline = batch
            .iter()
            .map(|write| write.deadline)
            .max()
            .unwrap_or_else(Instant::now);
        let asked = Instant::now();
        // Never past it either, so that the next transaction gets its turn.
        let transaction = async {
            let mut conn = self.writer(deadline).await?;
            // A lone write of one statement commits by itself: the same lock and the same
            // commit, two statements fewer. So does a lone take that holds the lock before it
            // waited long enough that leases get time back (it only knows once it holds it:
            // the statement itself checks); otherwise it runs in the transaction below.
            if let [write] = batch {
                if write.job.abandoned() {
                    return Ok(());
                }
                if write.job.is_one_statement() {
                    let ran = write.job.run(&write.sql, &mut conn).await;
                    self.waited(asked.elapsed());
                    return ran;
                }
                let locked_out_at = self.locked_out_since();
                if write
                    .job
                    .take_in_time(&write.sql, &mut conn, deadline, locked_out_at)
                    .await?
                {
                    return Ok(());
                }
            }
            let mut tx = conn.begin_with("BEGIN IMMEDIATE").await?;
            self.waited(asked.elapsed());
            give_time_back(&mut tx, batch, self.dark()).await?;
            for write in batch.iter_mut() {
                if !write.job.abandoned() {
                    write.job.run(&write.sql, &mut tx).await?;
                }
            }
            tx.commit().await
        };
        tokio::time::timeout_at(deadline, transaction)
            .await
            .unwrap_or_else(|_| {
                self.waited(asked.elapsed());
                Err(sqlx::Error::Io(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    "the file's write lock was not free in time",
                )))
            })
    }
}

/// When the file went without a commit for a quarter of a lease or more while its lock was
/// held (a writer paused or slow while it held it), the claims in progress get that dark
/// time back, once: their holders could not renew meanwhile either. The dark time is
/// measured by the file (`dark`: since any process last committed, when a write of this
/// process found the lock held within that time, see [`Writes::dark`]), or by a claim's
/// own wait for the lock if longer, never by one claimer's wait alone. Every claim in progress whose lease ran out within
/// it, or runs out within a lease, is extended by it (to a lease from now at most), and
/// marked: a marked claim gets no more until its holder renews (which clears the mark). A
/// live holder renews, and is covered again at the next lockout; a dead one's key frees
/// once the time given back is over, so within two leases, whatever the lock does. An idle
/// file, whose lock nobody found held, gives nothing back: a dead holder's key frees a
/// lease after its last renewal. One statement for the batch, for its longest lockout and
/// lease.
async fn give_time_back(
    tx: &mut SqliteConnection,
    batch: &[Write],
    dark: Duration,
) -> Result<(), sqlx::Error> {
    let mut takes: Option<(Duration, Duration)> = None;
    for write in batch {
        if let Job::Take { lease, started, .. } = &write.job {
            let (most, longest) = takes.unwrap_or_default();
            takes = Some((most.max(started.elapsed()), longest.max(*lease)));
        }
    }
    let Some((waited, lease)) = takes else {
        return Ok(());
    };
    let dark = dark.max(waited);
    if !locked_out(dark, lease) {
        return Ok(());
    }
    tracing::debug!(
        dark_ms = dark.as_millis() as u64,
        "the file went without a commit for long: leases get the time back, once"
    );
    let sql = &batch[0].sql;
    sqlx::query(&sql.credit)
        .bind(millis(dark))
        .bind(millis(lease))
        .execute(&mut *tx)
        .await?;
    Ok(())
}

impl Job {
    /// Takes `key` for a claim that began at `started`, unless a live row of another caller
    /// holds it: the new token, or that row.
    pub(super) fn take(
        key: &Key,
        fingerprint: Option<&Fingerprint>,
        lease: Duration,
        nonce: u64,
        started: Instant,
    ) -> (Self, Answered<Result<Token, SqliteRow>>) {
        let (answer, answered) = Answer::new();
        let job = Job::Take {
            key: *key,
            fingerprint: fingerprint.copied(),
            lease,
            nonce,
            started,
            answer,
        };
        (job, answered)
    }

    /// A holder's statement: whether it found the row under `token`.
    pub(super) fn fenced(
        statement: Fence,
        key: &Key,
        token: Token,
        value: Option<Bytes>,
        millis: Option<i64>,
    ) -> (Self, Answered<bool>) {
        let (answer, answered) = Answer::new();
        let job = Job::Fenced {
            statement,
            key: *key,
            token,
            value,
            millis,
            answer,
        };
        (job, answered)
    }

    /// Deletes `key`'s row: whether there was one, and whether it was live.
    pub(super) fn remove(key: &Key) -> (Self, Answered<Option<bool>>) {
        let (answer, answered) = Answer::new();
        (Job::Remove { key: *key, answer }, answered)
    }

    /// Runs a take by itself, outside a transaction, if it holds the file's write lock
    /// before `deadline` (when its caller stops waiting), before it waited
    /// [`LOCKED_OUT_FLOOR`] for it, and, when the file was found locked out since its last
    /// commit at `locked_out_at`, before a quarter of the lease passed since then
    /// ([`lockout`]; leases are then owed time back first): whether it took the key. A take
    /// that did not (a live row of another caller, a lockout) is left to the transaction.
    async fn take_in_time(
        &mut self,
        sql: &Statements,
        conn: &mut SqliteConnection,
        deadline: Instant,
        locked_out_at: Option<SystemTime>,
    ) -> Result<bool, sqlx::Error> {
        let Job::Take {
            key,
            fingerprint,
            lease,
            nonce,
            started,
            answer,
        } = self
        else {
            return Ok(false);
        };
        // That moment by SQLite's clock (the host's wall clock, which every lease is judged
        // by too; a clock stepped forward only sends the take to the transaction).
        let Some(left) = LOCKED_OUT_FLOOR
            .checked_sub(started.elapsed())
            .map(|left| left.min(deadline.saturating_duration_since(Instant::now())))
        else {
            return Ok(false);
        };
        let until = SystemTime::now()
            .checked_add(left)
            .into_iter()
            .chain(locked_out_at.and_then(|at| at.checked_add(lockout(*lease))))
            .min()
            .and_then(|until| until.duration_since(UNIX_EPOCH).ok())
            .and_then(|until| i64::try_from(until.as_millis()).ok());
        // Past already (a lockout since the last commit): straight to the transaction,
        // without taking the lock for a statement that could not write.
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .ok()
            .and_then(|now| i64::try_from(now.as_millis()).ok());
        let Some(until) = until.filter(|until| now.is_some_and(|now| now < *until)) else {
            return Ok(false);
        };
        let token: Option<i64> = sqlx::query_scalar(&sql.take_in_time)
            .bind(&key.as_bytes()[..])
            .bind(fingerprint.as_ref().map(|f| &f.as_bytes()[..]))
            .bind(millis(*lease))
            .bind(&nonce.to_be_bytes()[..])
            .bind(until)
            .fetch_optional(&mut *conn)
            .await?;
        let Some(token) = token else {
            return Ok(false);
        };
        answer.done = Some(Ok(Token::new(token.unsigned_abs())));
        Ok(true)
    }

    /// Whether the write is one statement, which needs no transaction of its own.
    fn is_one_statement(&self) -> bool {
        matches!(self, Job::Fenced { .. } | Job::Remove { .. })
    }

    /// Whether the caller stopped waiting for the answer.
    fn abandoned(&self) -> bool {
        match self {
            Job::Take { answer, .. } => answer.to.is_closed(),
            Job::Fenced { answer, .. } => answer.to.is_closed(),
            Job::Remove { answer, .. } => answer.to.is_closed(),
        }
    }

    /// Sends the caller what the write did once its transaction committed, or the error.
    fn answer(self, result: Result<(), sqlx::Error>) {
        match self {
            Job::Take { answer, .. } => answer.send(result),
            Job::Fenced { answer, .. } => answer.send(result),
            Job::Remove { answer, .. } => answer.send(result),
        }
    }

    /// Runs the write's statements in the batch's transaction, and keeps what they did.
    async fn run(
        &mut self,
        sql: &Statements,
        tx: &mut SqliteConnection,
    ) -> Result<(), sqlx::Error> {
        match self {
            Job::Take {
                key,
                fingerprint,
                lease,
                nonce,
                answer,
                ..
            } => {
                // One statement takes the key (see `Statements::take`); when a live row of
                // another caller stays, that row, read under the same lock, is the answer.
                let token: Option<i64> = sqlx::query_scalar(&sql.take)
                    .bind(&key.as_bytes()[..])
                    .bind(fingerprint.as_ref().map(|f| &f.as_bytes()[..]))
                    .bind(millis(*lease))
                    .bind(&nonce.to_be_bytes()[..])
                    .fetch_optional(&mut *tx)
                    .await?;
                answer.done = Some(match token {
                    Some(token) => Ok(Token::new(token.unsigned_abs())),
                    None => Err(sqlx::query(&sql.held)
                        .bind(&key.as_bytes()[..])
                        .fetch_one(&mut *tx)
                        .await?),
                });
            }
            Job::Fenced {
                statement,
                key,
                token,
                value,
                millis,
                answer,
            } => {
                let (text, step) = match statement {
                    Fence::Complete => (&sql.complete, None),
                    Fence::Release => (&sql.release, None),
                    Fence::Renew => (&sql.renew, None),
                    Fence::RecordStep(step) => (&sql.record_step, Some(step)),
                };
                let mut query = sqlx::query(text).bind(&key.as_bytes()[..]).bind(*token);
                if let Some(value) = value {
                    query = query.bind(&value[..]);
                }
                if let Some(millis) = millis {
                    query = query.bind(*millis);
                }
                if let Some(step) = step {
                    query = query.bind(&step.as_bytes()[..]);
                }
                answer.done = Some(query.execute(&mut *tx).await?.rows_affected() == 1);
            }
            Job::Remove { key, answer } => {
                let (first, last) = crate::store::sql::steps_range(key);
                sqlx::query(&sql.remove_steps)
                    .bind(&key.as_bytes()[..])
                    .bind(&first[..])
                    .bind(&last[..])
                    .execute(&mut *tx)
                    .await?;
                answer.done = Some(
                    sqlx::query_scalar(&sql.remove)
                        .bind(&key.as_bytes()[..])
                        .fetch_optional(&mut *tx)
                        .await?,
                );
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::sqlite::SqliteStore;
    use crate::Store;

    /// A file of the test's own, deleted (with its WAL) when dropped.
    struct File(std::path::PathBuf);

    impl Drop for File {
        fn drop(&mut self) {
            for suffix in ["", "-wal", "-shm"] {
                let _ = std::fs::remove_file(format!("{}{suffix}", self.0.display()));
            }
        }
    }

    async fn store(test: &str) -> (SqliteStore, File) {
        let file = File(std::env::temp_dir().join(format!(
            "idem-sqlite-writes-{test}-{}.db",
            std::process::id()
        )));
        drop(File(file.0.clone())); // what an earlier run left
        let store = SqliteStore::open(&file.0).await.unwrap();
        store.migrate().await.unwrap();
        (store, file)
    }

    fn later() -> Instant {
        Instant::now() + Duration::from_secs(10)
    }

    #[tokio::test]
    async fn a_bad_write_fails_only_its_own_caller() {
        let (store, _file) = store("bad").await;
        let key = Key::from_bytes([1; 32]);
        let Ok(crate::Claim::Acquired { token }) =
            store.claim(&key, None, Duration::from_secs(5)).await
        else {
            panic!("a fresh key is free");
        };
        // One batch: a renewal on a table that was never created, and one that exists.
        let missing = Arc::new(Statements::of("never_migrated"));
        let (bad, bad_answer) = Job::fenced(Fence::Renew, &key, token, None, Some(5000));
        let (good, good_answer) = Job::fenced(Fence::Renew, &key, token, None, Some(5000));
        let batch = vec![
            Write {
                job: bad,
                sql: missing,
                deadline: later(),
            },
            Write {
                job: good,
                sql: Arc::clone(&store.sql),
                deadline: later(),
            },
        ];
        store.writes.commit(batch).await;
        let bad = bad_answer.await.unwrap();
        assert!(
            bad.as_ref()
                .is_err_and(|err| err.to_string().contains("no such table")),
            "{bad:?}"
        );
        assert!(
            good_answer.await.unwrap().unwrap(),
            "the good renewal landed"
        );
    }

    #[tokio::test]
    async fn a_claim_whose_caller_stopped_waiting_is_not_taken() {
        let (store, _file) = store("abandoned").await;
        let (abandoned, answer) = Job::take(
            &Key::from_bytes([2; 32]),
            None,
            Duration::from_secs(5),
            1,
            Instant::now(),
        );
        drop(answer);
        let (waited, answered) = Job::take(
            &Key::from_bytes([3; 32]),
            None,
            Duration::from_secs(5),
            2,
            Instant::now(),
        );
        let batch = [abandoned, waited].map(|job| Write {
            job,
            sql: Arc::clone(&store.sql),
            deadline: later(),
        });
        store.writes.commit(batch.into()).await;
        assert!(matches!(answered.await.unwrap(), Ok(Ok(_))));
        assert_eq!(
            store.lease_left(&Key::from_bytes([2; 32])).await.unwrap(),
            None,
            "nobody holds the abandoned claim's key"
        );
        assert!(store
            .lease_left(&Key::from_bytes([3; 32]))
            .await
            .unwrap()
            .is_some());
    }
}
