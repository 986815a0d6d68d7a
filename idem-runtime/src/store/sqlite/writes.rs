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
//!
//! A claim or a completion commits in its caller's task, which awaits nothing else of its
//! call (a task of its own takes the commit over if the caller stops waiting, so that the
//! others' writes in the batch still commit). A renewal or a step's record, made beside a
//! body that may keep its task's thread busy, commits in a task of its own.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use sqlx::sqlite::{SqlitePool, SqliteRow};
use sqlx::{Connection, SqliteConnection};
use tokio::sync::{oneshot, OwnedMutexGuard};
use tokio::time::Instant;

use super::beacon::Beacon;
use super::statements::Statements;
use super::{locked_out, lockout, LOCKED_OUT_FLOOR};
use crate::namespace::Namespace;
use crate::store::sql::{millis, Fenced};
use crate::store::Holder;
use crate::{Claim, ClaimRequest, Fingerprint, Key, Token};

/// How long SQLite's busy handler waits for the file's lock before a write looks again.
///
/// SQLite's own handler sleeps longer each time (up to 100 ms) until its busy timeout, and
/// misses a lock that is free for less than that: another process that holds the lock for
/// seconds and lets go of it for 20 ms at a time would keep a waiting write out for many of
/// its turns. The handler waits this long instead (it looks 5 times, at most 5 ms apart),
/// and the write, still locked out, runs again until its deadline: a lock free for a few
/// milliseconds is found.
pub(super) const POLL: Duration = Duration::from_millis(10);

/// How long a process that waited for the lock stays off it after its transaction: longer
/// than the longest pause between two looks of a waiting write's busy handler (5 ms), so
/// that one in another process finds it free ([`Writes::commit`]).
const HANDOFF: Duration = Duration::from_millis(6);

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
    /// Takes `key` unless a live row of another caller holds it: the claim, or that row.
    Take {
        key: Key,
        fingerprint: Option<Fingerprint>,
        lease: Duration,
        /// How long a claim that lapses unsettled is kept.
        ttl: Duration,
        nonce: u64,
        /// The claimant's namespace and label, kept on the row.
        namespace: Option<Namespace>,
        label: Option<String>,
        /// When the claim began: a claim that waited long gives leases time back.
        started: Instant,
        answer: Answer<Result<Claim, SqliteRow>>,
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
    /// When this process began to find the file's lock held, if no write here has held it
    /// since: the start of the first wait for it (a write that waited, or gave up) since
    /// one last got it. The time the file was dark to this process, whoever held it.
    locked_out: Mutex<Option<Instant>>,
    /// Whether the transaction running now found the lock held at least once.
    found_held: AtomicBool,
    /// Where this process tells the others on the file how long it has waited for the lock,
    /// and reads how long they have ([`beacon`](super::beacon)).
    beacon: Beacon,
}

/// What a write that finds the file's lock held does besides looking again: notes it for
/// the pause after its transaction, and for the other processes on the file.
struct Looks<'a> {
    found_held: &'a AtomicBool,
    beacon: &'a Beacon,
    /// Since when the file has been dark to this process.
    dark_since: Instant,
}

impl Writes {
    /// The queue of writes on `conn`, whose connections' busy handlers wait [`POLL`], and
    /// which notes its waits with `beacon`.
    pub(super) fn new(conn: SqlitePool, beacon: Beacon) -> Self {
        Self {
            conn,
            queue: Mutex::default(),
            turn: Arc::default(),
            locked_out: Mutex::default(),
            found_held: AtomicBool::new(false),
            beacon,
        }
    }

    fn locked_out(&self) -> std::sync::MutexGuard<'_, Option<Instant>> {
        self.locked_out
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Since when the file has been dark to this process, for a write that asked for its
    /// lock at `asked`: the lockout that began before it, or its own wait.
    fn dark_since(&self, asked: Instant) -> Instant {
        self.locked_out().map_or(asked, |since| since.min(asked))
    }

    /// Notes that a write that asked at `asked` gave up on the file's lock: the lockout goes
    /// on from the earliest such wait until a write here holds the lock.
    fn gave_up(&self, asked: Instant) {
        let since = self.dark_since(asked);
        *self.locked_out() = Some(since);
    }

    /// Notes that a write here held the file's lock: it was not dark to this process then.
    fn held(&self) {
        *self.locked_out() = None;
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
        let beside_a_body = job.beside_a_body();
        self.queue().push(Write {
            job,
            sql: Arc::clone(sql),
            deadline,
        });
        let turn = Arc::clone(&self.turn).lock_owned().await;
        let batch = std::mem::take(&mut *self.queue());
        if !batch.is_empty() {
            let writes = Arc::clone(self);
            let commit = async move { writes.commit(batch, turn).await };
            if beside_a_body {
                // Its task may be busy with the body: the others' writes must not wait on it.
                tokio::spawn(commit);
            } else {
                // Run in the caller's task, which awaits nothing else of the call, and handed
                // to a task of its own only if the caller stops waiting, so that it does not
                // stop the others' writes: no hand-off between tasks otherwise.
                let runtime = tokio::runtime::Handle::current();
                crate::background::finish_if_dropped(runtime, commit).await;
            }
        }
        answered.await.unwrap_or(Err(sqlx::Error::WorkerCrashed))
    }

    fn queue(&self) -> std::sync::MutexGuard<'_, Vec<Write>> {
        self.queue.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Commits `batch` in one transaction and answers each write; if that fails, each
    /// write runs again alone, so that one bad write fails only its own caller.
    ///
    /// After a transaction that found the lock held, the process stays off it for
    /// [`HANDOFF`] before its next one. SQLite's lock is no queue: a
    /// process whose writes keep coming would take it again the moment it let go, before
    /// the writes of other processes, asleep in their busy handlers, look again; under load
    /// a live holder there could then miss its renewals for a whole lease.
    async fn commit(&self, batch: Vec<Write>, turn: OwnedMutexGuard<()>) {
        self.settle(batch).await;
        if self.found_held.swap(false, Ordering::Relaxed) {
            // The turn is held through the pause by a task of its own: the batch's callers
            // have their answers already, and need not wait for it.
            tokio::spawn(async move {
                tokio::time::sleep(HANDOFF).await;
                drop(turn);
            });
        }
    }

    /// Commits `batch` and answers its writes (see [`commit`](Self::commit)).
    async fn settle(&self, mut batch: Vec<Write>) {
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
        let looks = Looks {
            found_held: &self.found_held,
            beacon: &self.beacon,
            dark_since: self.dark_since(asked),
        };
        // Never past it either, so that the next transaction gets its turn.
        let transaction = async {
            let mut conn = self.conn.acquire().await?;
            // A lone write of one statement commits by itself: the same lock and the same
            // commit, two statements fewer. So does a lone take that holds the lock before it
            // waited long enough that leases get time back (it only knows once it holds it:
            // the statement itself checks); otherwise it runs in the transaction below.
            if let [write] = batch {
                if write.job.abandoned() {
                    return Ok(());
                }
                if write.job.is_one_statement() {
                    loop {
                        let tried = Instant::now();
                        let ran = write.job.run(&write.sql, &mut conn).await;
                        if !again(&ran, deadline, tried, &looks).await {
                            return ran;
                        }
                    }
                }
                if write
                    .job
                    .take_in_time(&write.sql, &mut conn, deadline, &looks)
                    .await?
                {
                    return Ok(());
                }
            }
            let mut tx = loop {
                let tried = Instant::now();
                let begun = conn.begin_with("BEGIN IMMEDIATE").await;
                if !again(&begun, deadline, tried, &looks).await {
                    break begun?;
                }
            };
            give_time_back(&mut tx, batch, looks.dark_since, &self.beacon).await?;
            for write in batch.iter_mut() {
                if !write.job.abandoned() {
                    write.job.run(&write.sql, &mut tx).await?;
                }
            }
            tx.commit().await
        };
        let done = tokio::time::timeout_at(deadline, transaction)
            .await
            .unwrap_or_else(|_| {
                Err(sqlx::Error::Io(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    "the file's write lock was not free in time",
                )))
            });
        match &done {
            Ok(()) => self.held(),
            Err(err) if locked(err) => self.gave_up(asked),
            Err(_) => {}
        }
        done
    }
}

/// Whether `err` is the file's lock held by another connection (SQLite's busy, after the
/// handler's wait), or a write's deadline that passed while it waited for it.
fn locked(err: &sqlx::Error) -> bool {
    match err {
        sqlx::Error::Database(err) => err
            .code()
            .and_then(|code| code.parse::<u32>().ok())
            .is_some_and(|code| code & 0xff == SQLITE_BUSY),
        sqlx::Error::Io(err) => err.kind() == std::io::ErrorKind::TimedOut,
        _ => false,
    }
}

/// Whether a write that began at `tried` and ended with `result` found the file's lock held
/// (noted in `looks`) and has time left before `deadline` to look again. SQLite's busy
/// handler waited [`POLL`] before it answered busy, except for a write whose snapshot went
/// stale, which is answered at once: that one waits a millisecond, so that the loop never
/// spins.
async fn again<T>(
    result: &Result<T, sqlx::Error>,
    deadline: Instant,
    tried: Instant,
    looks: &Looks<'_>,
) -> bool {
    let busy = matches!(result, Err(err @ sqlx::Error::Database(_)) if locked(err));
    if busy {
        looks.found_held.store(true, Ordering::Relaxed);
        looks.beacon.waiting(looks.dark_since);
    }
    if !busy || Instant::now() >= deadline {
        return false;
    }
    if tried.elapsed() < Duration::from_millis(1) {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    true
}

/// SQLite's primary result code for a lock held by another connection.
const SQLITE_BUSY: u32 = 5;

/// When the file was dark for a quarter of a lease or more (a writer of another process
/// paused or slow while it held the lock), the claims in progress get that time back, once:
/// their holders may not have been able to renew meanwhile either. The dark time is the
/// longest of this process's (since `dark_since`, when it began to find the lock held
/// without getting it, over failed tries too: [`Writes::dark_since`]), a claim's own wait,
/// and what another process on the file noted of its own wait and still renews or renewed
/// lately ([`Beacon::dark_since`]): a duplicate that came late in a freeze, or just after
/// it, sees the wait of the holder whose renewal is still waiting. A time when nobody
/// waited for the lock is not counted: the lock may have been free, or nobody wanted it.
///
/// Every claim in progress whose lease runs out within the time given back, or ran out
/// within the dark time or a quarter of a lease before it (a holder may have been kept
/// out just before anyone noticed), gets a lease that ends that long from now (a
/// lease at most), and is marked: a marked claim gets no more until its holder renews
/// (which clears the mark). A live holder, whose renewal has been waiting for the lock too,
/// renews, and is covered again at the next lockout, however long the freeze was; a dead
/// one's key frees once the time given back is over: given within a lease of its last
/// renewal or at the first turn on the lock after it, and for the time the lock was not
/// found free, whatever the lock does meanwhile. An idle file, whose lock nobody waited
/// for, gives nothing back: a dead holder's key frees a lease after its last renewal. One
/// statement for the batch, for its longest lockout and lease.
async fn give_time_back(
    tx: &mut SqliteConnection,
    batch: &[Write],
    dark_since: Instant,
    beacon: &Beacon,
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
    let noted = beacon.dark_since(lease).map(|since| since.elapsed());
    let dark = dark_since
        .elapsed()
        .max(waited)
        .max(noted.unwrap_or_default());
    if !locked_out(dark, lease) {
        return Ok(());
    }
    tracing::debug!(
        dark_ms = dark.as_millis() as u64,
        "the file's lock was not found free for long: leases get the time back, once"
    );
    let sql = &batch[0].sql;
    sqlx::query(&sql.credit)
        .bind(millis(dark.min(lease)))
        .bind(millis(dark + lockout(lease)))
        .execute(&mut *tx)
        .await?;
    Ok(())
}

impl Job {
    /// Takes the request's key for a claim that began at `started`, unless a live row of
    /// another caller holds it: the claim, or that row.
    pub(super) fn take(
        request: &ClaimRequest<'_>,
        started: Instant,
    ) -> (Self, Answered<Result<Claim, SqliteRow>>) {
        let (answer, answered) = Answer::new();
        let job = Job::Take {
            key: *request.key,
            fingerprint: request.fingerprint.copied(),
            lease: request.lease,
            ttl: request.ttl,
            nonce: request.nonce,
            namespace: request.claimant.kept(),
            label: request.claimant.label().map(str::to_owned),
            started,
            answer,
        };
        (job, answered)
    }

    /// A holder's statement: whether it found the row under `token`.
    pub(super) fn fenced(key: &Key, token: Token, write: Fenced<'_>) -> (Self, Answered<bool>) {
        let (statement, value, millis) = match write {
            Fenced::Complete { value, ttl } => (Fence::Complete, Some(value), Some(millis(ttl))),
            Fenced::Release => (Fence::Release, None, None),
            Fenced::Renew { lease } => (Fence::Renew, None, Some(millis(lease))),
            Fenced::Step { step, value, ttl } => {
                (Fence::RecordStep(*step), Some(value), Some(millis(ttl)))
            }
        };
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
    /// [`LOCKED_OUT_FLOOR`] for it, and before the file was dark for a quarter of the lease
    /// ([`lockout`]; leases are then owed time back first), to this process (since
    /// `looks.dark_since`) or to another that noted it: whether it took the key. A take
    /// that did not (a live row of another caller, a lockout) is left to the transaction.
    async fn take_in_time(
        &mut self,
        sql: &Statements,
        conn: &mut SqliteConnection,
        deadline: Instant,
        looks: &Looks<'_>,
    ) -> Result<bool, sqlx::Error> {
        let Job::Take {
            key,
            fingerprint,
            lease,
            ttl,
            nonce,
            namespace,
            label,
            started,
            answer,
        } = self
        else {
            return Ok(false);
        };
        // Past already (a long wait, or a lockout): straight to the transaction, without
        // taking the lock for a statement that could not write.
        let dark_since = looks
            .beacon
            .dark_since(*lease)
            .map_or(looks.dark_since, |noted| noted.min(looks.dark_since));
        let Some(left) = LOCKED_OUT_FLOOR
            .checked_sub(started.elapsed())
            .zip(lockout(*lease).checked_sub(dark_since.elapsed()))
            .map(|(own, dark)| own.min(dark))
            .map(|left| left.min(deadline.saturating_duration_since(Instant::now())))
            .filter(|left| !left.is_zero())
        else {
            return Ok(false);
        };
        // That moment by SQLite's clock (the host's wall clock, which every lease is judged
        // by too; a clock stepped forward only sends the take to the transaction).
        let Some(until) = SystemTime::now()
            .checked_add(left)
            .and_then(|until| until.duration_since(UNIX_EPOCH).ok())
            .and_then(|until| i64::try_from(until.as_millis()).ok())
        else {
            return Ok(false);
        };
        // Every row fetched, so that the statement runs to its end: by itself it commits
        // there, and a commit that fails (a full disk) fails the take. Fetching one row
        // would reset it after the `RETURNING` row, and the reset's error is not seen: the
        // take would answer a token that was never written, and the body run unclaimed.
        let tokens: Vec<(i64, bool)> = loop {
            let tried = Instant::now();
            let tokens = sqlx::query_as(&sql.take_in_time)
                .bind(&key.as_bytes()[..])
                .bind(fingerprint.as_ref().map(|f| &f.as_bytes()[..]))
                .bind(millis(*lease))
                .bind(&nonce.to_be_bytes()[..])
                .bind(namespace.as_deref())
                .bind(label.as_deref())
                .bind(Holder::this_process_text())
                .bind(until)
                .bind(crate::store::sql::kept_ms(*ttl))
                .fetch_all(&mut *conn)
                .await;
            if !again(&tokens, deadline, tried, looks).await {
                break tokens?;
            }
        };
        let Some(&(token, taken_over)) = tokens.first() else {
            return Ok(false);
        };
        answer.done = Some(Ok(Claim::Acquired {
            token: Token::new(token.unsigned_abs()),
            taken_over,
        }));
        Ok(true)
    }

    /// Whether the write is made beside a running body, in the body's task: a renewal (the
    /// heartbeat is polled beside the body) or a step's record (made from inside it). A
    /// body may keep its thread busy for seconds; a commit polled in its task would wait
    /// as long, and every write queued behind the turn with it.
    fn beside_a_body(&self) -> bool {
        matches!(
            self,
            Job::Fenced {
                statement: Fence::Renew | Fence::RecordStep(_),
                ..
            }
        )
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
                ttl,
                nonce,
                namespace,
                label,
                answer,
                ..
            } => {
                // One statement takes the key (see `Statements::take`); when a live row of
                // another caller stays, that row, read under the same lock, is the answer.
                let taken: Option<(i64, bool)> = sqlx::query_as(&sql.take)
                    .bind(&key.as_bytes()[..])
                    .bind(fingerprint.as_ref().map(|f| &f.as_bytes()[..]))
                    .bind(millis(*lease))
                    .bind(&nonce.to_be_bytes()[..])
                    .bind(namespace.as_deref())
                    .bind(label.as_deref())
                    .bind(Holder::this_process_text())
                    .bind(crate::store::sql::kept_ms(*ttl))
                    .fetch_optional(&mut *tx)
                    .await?;
                answer.done = Some(match taken {
                    Some((token, taken_over)) => Ok(Claim::Acquired {
                        token: Token::new(token.unsigned_abs()),
                        taken_over,
                    }),
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
    use crate::store::Claimant;
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

    /// A claim of the key made of `byte`, its nonce `byte` too, begun now.
    fn take(byte: u8) -> (Job, Answered<Result<Claim, SqliteRow>>) {
        let key = Key::from_bytes([byte; 32]);
        let request = ClaimRequest::new(&key, Duration::from_secs(5))
            .nonce(byte.into())
            .claimant(Claimant::new("test"));
        Job::take(&request, Instant::now())
    }

    /// `job` as it waits in the store's queue.
    fn queued(store: &SqliteStore, job: Job) -> Write {
        Write {
            job,
            sql: Arc::clone(&store.driver().sql),
            deadline: later(),
        }
    }

    /// Whether a live claim holds the key made of `byte`.
    async fn held(store: &SqliteStore, byte: u8) -> bool {
        let key = Key::from_bytes([byte; 32]);
        store.lease_left(&key).await.unwrap().is_some()
    }

    fn later() -> Instant {
        Instant::now() + Duration::from_secs(10)
    }

    #[tokio::test]
    async fn a_bad_write_fails_only_its_own_caller() {
        let (store, _file) = store("bad").await;
        let key = Key::from_bytes([1; 32]);
        let Ok(crate::Claim::Acquired { token, .. }) = store
            .claim(&ClaimRequest::new(&key, Duration::from_secs(5)))
            .await
        else {
            panic!("a fresh key is free");
        };
        // One batch: a renewal on a table that was never created, and one that exists.
        let missing = Arc::new(Statements::of("never_migrated"));
        let (bad, bad_answer) = Job::fenced(
            &key,
            token,
            Fenced::Renew {
                lease: Duration::from_millis(5000),
            },
        );
        let (good, good_answer) = Job::fenced(
            &key,
            token,
            Fenced::Renew {
                lease: Duration::from_millis(5000),
            },
        );
        let batch = vec![
            Write {
                job: bad,
                sql: missing,
                deadline: later(),
            },
            queued(&store, good),
        ];
        let turn = Arc::clone(&store.driver().writes.turn).lock_owned().await;
        store.driver().writes.commit(batch, turn).await;
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

    /// The caller that took the turn commits the whole batch in its own task: when it stops
    /// waiting mid-commit, the writes of the others in its batch still commit and are
    /// answered (the commit goes on in a task of its own), and its own is left out.
    #[tokio::test]
    async fn a_caller_that_stops_waiting_mid_commit_keeps_the_others_writes() {
        let (store, file) = store("dropped-mid-commit").await;
        // Another connection holds the file's write lock: the batch's commit waits for it.
        let mut other = SqliteConnection::connect(&format!("sqlite://{}", file.0.display()))
            .await
            .unwrap();
        sqlx::query("BEGIN IMMEDIATE")
            .execute(&mut other)
            .await
            .unwrap();
        // Another caller's claim, queued: the next caller with the turn takes it along.
        let (other_claim, answered) = take(4);
        store
            .driver()
            .writes
            .queue()
            .push(queued(&store, other_claim));
        let writes = Arc::clone(&store.driver().writes);
        let sql = Arc::clone(&store.driver().sql);
        let job = take(5);
        let caller = tokio::spawn(async move { writes.run(&sql, job, later()).await.is_ok() });
        // The caller took the batch (both writes) and is committing it, held by the lock.
        while !store.driver().writes.queue().is_empty()
            || store.driver().writes.turn.try_lock().is_ok()
        {
            tokio::task::yield_now().await;
        }
        caller.abort();
        assert!(caller.await.unwrap_err().is_cancelled());
        sqlx::query("ROLLBACK").execute(&mut other).await.unwrap();
        assert!(
            matches!(answered.await.unwrap(), Ok(Ok(_))),
            "the other caller's claim committed"
        );
        assert!(held(&store, 4).await);
        // The turn comes back once that commit is over: a write after it goes through.
        let later_key = Key::from_bytes([6; 32]);
        let after = store
            .claim(&ClaimRequest::new(&later_key, Duration::from_secs(5)))
            .await;
        assert!(
            matches!(after, Ok(crate::Claim::Acquired { .. })),
            "a later claim is taken"
        );
        assert!(
            !held(&store, 5).await,
            "the claim of the caller that stopped waiting is not taken"
        );
    }

    /// A renewal is made beside its body, in the body's task, and a step's record from
    /// inside it. When that body keeps its thread busy right after such a write took the
    /// turn, another task's claim still commits: the write's commit runs in a task of its
    /// own.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_renewal_beside_a_busy_body_does_not_hold_up_the_others_writes() {
        beside_a_busy_body("renewal-beside-busy-body", false).await;
    }

    /// [`a_renewal_beside_a_busy_body_does_not_hold_up_the_others_writes`], for a step's
    /// record.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_step_record_beside_a_busy_body_does_not_hold_up_the_others_writes() {
        beside_a_busy_body("step-beside-busy-body", true).await;
    }

    /// A renewal (or, with `step`, a step's record) made in a task that then keeps its
    /// thread until another task's claim has landed.
    async fn beside_a_busy_body(test: &str, step: bool) {
        let (store, _file) = store(test).await;
        let held = Key::from_bytes([7; 32]);
        let Ok(crate::Claim::Acquired { token, .. }) = store
            .claim(&ClaimRequest::new(&held, Duration::from_secs(5)))
            .await
        else {
            panic!("a fresh key is free");
        };
        let (landed, heard) = std::sync::mpsc::channel();
        let other = store.clone();
        let body = tokio::spawn(async move {
            let step_key = Key::from_bytes([9; 32]);
            let lease = Duration::from_secs(5);
            let mut write = if step {
                store.record_step(&held, token, &step_key, Bytes::from_static(b"1"), lease)
            } else {
                store.renew(&held, token, lease)
            };
            // Polled once: the write holds the turn, its statement under way.
            let pending = std::future::poll_fn(|cx| {
                std::task::Poll::Ready(write.as_mut().poll(cx).is_pending())
            });
            assert!(pending.await, "a write waits for SQLite's thread");
            // The task yields once, as a body's task does between its polls (a task spawned
            // here is polled then), and the body then keeps this task's thread until the
            // other task's claim has landed. (The bound only ends a run that would
            // otherwise never finish.)
            tokio::task::yield_now().await;
            heard
                .recv_timeout(Duration::from_secs(120))
                .expect("the other task's claim landed while this body held its thread");
            write.await
        });
        let fresh = Key::from_bytes([8; 32]);
        let claimed = other
            .claim(&ClaimRequest::new(&fresh, Duration::from_secs(5)))
            .await;
        landed.send(()).unwrap();
        assert!(
            matches!(claimed, Ok(crate::Claim::Acquired { .. })),
            "{:?}",
            claimed.as_ref().err()
        );
        assert!(body.await.unwrap().unwrap(), "the write landed too");
    }

    #[tokio::test]
    async fn a_claim_whose_caller_stopped_waiting_is_not_taken() {
        let (store, _file) = store("abandoned").await;
        let (abandoned, answer) = take(2);
        drop(answer);
        let (waited, answered) = take(3);
        let batch = [abandoned, waited].map(|job| queued(&store, job));
        let turn = Arc::clone(&store.driver().writes.turn).lock_owned().await;
        store.driver().writes.commit(batch.into(), turn).await;
        assert!(matches!(answered.await.unwrap(), Ok(Ok(_))));
        assert!(
            !held(&store, 2).await,
            "nobody holds the abandoned claim's key"
        );
        assert!(held(&store, 3).await);
    }
}
