//! Apache Kafka and Kafka-protocol brokers, through `rdkafka` (feature `rdkafka`).
//!
//! Kafka has no per-record acknowledgement: a consumer group commits, per partition, the
//! offset to read from next, and everything below it counts as done. Committing the offset
//! of a finished record while a lower one is still running skips the lower one for good if
//! the consumer dies. So a [`KafkaGroup`] runs records (one at a time by default, up to
//! [`concurrency`](KafkaGroup::concurrency) at once), keeps each partition's **watermark**,
//! the lowest offset still unfinished, and stores only that as the offset to commit (with
//! librdkafka's `enable.auto.offset.store` off: the at-least-once idiom, done for you). A
//! consumer killed anywhere leaves its partitions' commits at or below its first unfinished
//! record; the next owner reads from there, and the records it gets again replay (their
//! claims are recorded) or wait for the claim's holder.
//!
//! | disposition | Kafka |
//! |---|---|
//! | [`Ack`](Disposition::Ack) | the record is finished: the watermark moves past it once every record below it is finished too |
//! | [`Requeue`](Disposition::Requeue) | retried in place after the backoff, holding the watermark: a partition is an ordered log, with no later redelivery to ask for |
//! | [`Reject`](Disposition::Reject) | produced to the [dead-letter topic](KafkaGroup::dead_letter) (key, payload and headers, plus where it came from), then finished and committed at once; finished with an error logged when there is none |
//!
//! **Attempts are counted in the consumer**: Kafka counts no deliveries, so a record's
//! [`deliveries`](Delivery::deliveries) are this process's attempts at it, and a record
//! that keeps failing transiently is rejected after
//! [`max_deliveries`](super::Consumer::max_deliveries) of them instead of holding its
//! partition forever.
//!
//! **The message id.** Kafka records have none. [`MessageId::broker`](super::MessageId::broker)
//! is the record's coordinates, `<cluster>/<group>/<topic>/<partition>/<offset>`: always
//! with the cluster's name (which Kafka does not tell a client: you give it to
//! [`KafkaGroup::join`]) and the consumer group, so that two clusters' `orders/0/42` or two
//! groups' are never one record. Coordinates key the broker's redeliveries only: a
//! producer that retries a send without idempotence writes the record twice, at two
//! offsets. A producer that may send twice puts its own id in a header
//! ([`MessageId::header`](super::MessageId::header)) or the payload
//! ([`MessageId::json`](super::MessageId::json)).
//!
//! **Rebalances.** Each assignment of a partition to the member starts an epoch of it. A
//! record whose partition was revoked while it ran runs to its end, but stores no offset
//! and sends no dead letter: the partition's new reader (another member, or this one
//! again) reads it from the last commit, below it, and replays it, waits for its claim, or
//! rejects it. Nothing runs twice and nothing is skipped. The member keeps polling while
//! [`concurrency`](KafkaGroup::concurrency) records run (64 records read ahead, then its
//! partitions paused), so that it serves its group's rebalances and stays in the group
//! however slow a handler is.
//!
//! **The dead letter is sent once.** A rejected record waits until every record read before
//! it in its partition is finished, so that the commit right after its dead letter passes
//! it (a member that dies while it waits has sent nothing, and the next reader sends it);
//! from the dead letter to that synchronous commit, the member serves no rebalance, so no
//! other member reads the record meanwhile. One window is left: a member that dies in the
//! round trip between the dead-letter topic's acknowledgement and the commit; the next
//! reader rejects the record again. Each dead letter carries its source in the headers
//! `idem-source-cluster`, `idem-source-topic`, `idem-source-partition` and
//! `idem-source-offset`, so that whoever reads the dead-letter topic can drop such a second
//! copy.
//!
//! ```no_run
//! # async fn consume(store: idem_runtime::MemoryStore) -> Result<(), idem_runtime::BoxError> {
//! use idem_runtime::consumer::{kafka::KafkaGroup, Consumer, MessageId};
//! use rdkafka::ClientConfig;
//! # #[derive(serde::Deserialize)] struct Order { id: u64 }
//! # async fn ship(order: Order) -> Result<u64, idem_runtime::Error> { Ok(order.id) }
//!
//! let consumer = &Consumer::new("shop.orders.v1").store(store).message_id(MessageId::json("/id"));
//! let config = ClientConfig::new()
//!     .set("bootstrap.servers", "kafka-1:9092")
//!     .set("group.id", "shipper")
//!     .clone();
//! let group = KafkaGroup::join(&config, "prod-eu", &["orders"])?.dead_letter("orders.dead")?;
//! group.run(|record| async move { consumer.handle(&record, ship).await }).await
//! # }
//! ```

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use futures_util::stream::{FuturesUnordered, StreamExt};
use futures_util::FutureExt as _;
use rdkafka::client::ClientContext;
use rdkafka::consumer::{
    BaseConsumer, CommitMode, Consumer as _, ConsumerContext, Rebalance, StreamConsumer,
};
use rdkafka::message::{Header, Headers, Message, OwnedHeaders, OwnedMessage};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::{ClientConfig, Offset, TopicPartitionList};

use super::{Delivery, Disposition};
use crate::{BoxError, Error};

/// How many records a member reads ahead of those it runs before it pauses its partitions.
const AHEAD: usize = 64;

/// How long a run's end waits for librdkafka to move a partition back to its first
/// unfinished record.
const SEEK_TIMEOUT: Duration = Duration::from_secs(5);

/// A member of a Kafka consumer group, subscribed to its topics, that runs each record
/// through a handler and commits each partition's offset only below its first unfinished
/// record. Cheap to clone: clones share one member.
#[derive(Clone)]
pub struct KafkaGroup {
    inner: Arc<Group>,
    concurrency: usize,
}

struct Group {
    consumer: StreamConsumer<GroupContext>,
    cluster: String,
    group: String,
    /// The config the consumer was made from, for the dead-letter producer.
    config: ClientConfig,
    /// The producer and topic rejected records go to.
    dead_letter: Option<(FutureProducer, String)>,
    /// Held while a dead letter is sent.
    dead_letters: tokio::sync::Mutex<()>,
    /// Records dead-lettered whose offsets are not committed yet: while there are any, the
    /// member serves no rebalance, so that no other member reads them again meanwhile.
    rejecting: AtomicUsize,
    /// The records running, by partition and epoch.
    marks: Mutex<Watermarks>,
    /// Whether a run ended with a partition it could not move back to its first unfinished
    /// record: later runs would read past records nobody ran, so they refuse.
    lost: AtomicBool,
}

impl Group {
    fn marks(&self) -> std::sync::MutexGuard<'_, Watermarks> {
        self.marks.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether `record`'s partition has stayed this member's since the record was read.
    fn owns(&self, record: &KafkaRecord) -> bool {
        let message = &record.message;
        self.consumer
            .context()
            .epoch(message.topic(), message.partition())
            == Some(record.epoch)
    }
}

/// What librdkafka tells a member of its rebalances: each assignment of a partition starts
/// a new epoch of it, and a record read in one epoch counts for nothing in the next. A
/// partition taken away and given back is read again from its last commit, so a record
/// of an earlier epoch neither stores its offset nor dead-letters: its new reader does.
pub struct GroupContext {
    epochs: Mutex<Epochs>,
    /// Bumped when a record finishes and when partitions move: what a rejected record
    /// waiting for the records before it watches.
    progress: tokio::sync::watch::Sender<u64>,
}

impl Default for GroupContext {
    fn default() -> Self {
        Self {
            epochs: Mutex::default(),
            progress: tokio::sync::watch::Sender::new(0),
        }
    }
}

#[derive(Default)]
struct Epochs {
    last: u64,
    current: HashMap<(String, i32), u64>,
}

impl GroupContext {
    fn progressed(&self) {
        self.progress.send_modify(|n| *n = n.wrapping_add(1));
    }

    fn epoch(&self, topic: &str, partition: i32) -> Option<u64> {
        let epochs = self.epochs.lock().unwrap_or_else(PoisonError::into_inner);
        epochs.current.get(&(topic.to_owned(), partition)).copied()
    }
}

impl ClientContext for GroupContext {}

impl ConsumerContext for GroupContext {
    fn pre_rebalance(&self, _: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Revoke(revoked) = rebalance {
            let mut epochs = self.epochs.lock().unwrap_or_else(PoisonError::into_inner);
            for partition in revoked.elements() {
                epochs
                    .current
                    .remove(&(partition.topic().to_owned(), partition.partition()));
            }
            drop(epochs);
            self.progressed();
        }
    }

    fn post_rebalance(&self, _: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Assign(assigned) = rebalance {
            let mut epochs = self.epochs.lock().unwrap_or_else(PoisonError::into_inner);
            for partition in assigned.elements() {
                epochs.last += 1;
                let epoch = epochs.last;
                epochs
                    .current
                    .insert((partition.topic().to_owned(), partition.partition()), epoch);
            }
            drop(epochs);
            self.progressed();
        }
    }
}

impl std::fmt::Debug for KafkaGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaGroup")
            .field("cluster", &self.inner.cluster)
            .field("group", &self.inner.group)
            .field(
                "dead_letter",
                &self.inner.dead_letter.as_ref().map(|(_, topic)| topic),
            )
            .field("concurrency", &self.concurrency)
            .finish_non_exhaustive()
    }
}

impl KafkaGroup {
    /// Joins the consumer group `config` names (`group.id`, required) on the cluster
    /// `cluster` (a stable name of your choosing: it is part of every record's
    /// coordinates), subscribed to `topics`. `config` is used as it is, except that offsets
    /// are stored only by the group (`enable.auto.offset.store=false`) and committed by
    /// librdkafka in the background (`enable.auto.commit=true`): those two are what keeps
    /// a commit below every unfinished record.
    ///
    /// # Errors
    ///
    /// [`Error::Config`] for a config without `group.id` or an empty cluster name (or one
    /// with `/`, the coordinates' separator); rdkafka's, when the consumer cannot be made
    /// or subscribed.
    pub fn join(config: &ClientConfig, cluster: &str, topics: &[&str]) -> Result<Self, BoxError> {
        if cluster.is_empty() || cluster.contains('/') {
            return Err(Error::config(format!(
                "a Kafka cluster's name keys its records: {cluster:?} must be non-empty, without `/`"
            ))
            .into());
        }
        let Some(group) = config.get("group.id").filter(|id| !id.is_empty()) else {
            return Err(Error::config(
                "a KafkaGroup needs `group.id` in its config: its commits are the group's",
            )
            .into());
        };
        let group = group.to_owned();
        let consumer: StreamConsumer<GroupContext> = config
            .clone()
            .set("enable.auto.offset.store", "false")
            .set("enable.auto.commit", "true")
            .create_with_context(GroupContext::default())?;
        consumer.subscribe(topics)?;
        Ok(Self {
            inner: Arc::new(Group {
                consumer,
                cluster: cluster.to_owned(),
                group,
                config: config.clone(),
                dead_letter: None,
                dead_letters: tokio::sync::Mutex::new(()),
                rejecting: AtomicUsize::new(0),
                marks: Mutex::default(),
                lost: AtomicBool::new(false),
            }),
            concurrency: 1,
        })
    }

    /// Sends rejected records to `topic`, through an idempotent producer made from the
    /// group's config (its `bootstrap.servers` and security settings). Without a
    /// dead-letter topic a rejected record is logged and skipped.
    ///
    /// # Errors
    ///
    /// rdkafka's, when the producer cannot be made. Called on a group that has been
    /// cloned, [`Error::Config`]: a clone shares its member, whose settings are fixed.
    pub fn dead_letter(mut self, topic: &str) -> Result<Self, BoxError> {
        let group = Arc::get_mut(&mut self.inner).ok_or_else(|| {
            Error::config("set a KafkaGroup's dead-letter topic before cloning it")
        })?;
        let mut config = ClientConfig::new();
        for (name, value) in group.config.config_map() {
            if is_shared_setting(name) {
                config.set(name, value);
            }
        }
        let producer: FutureProducer = config.set("enable.idempotence", "true").create()?;
        group.dead_letter = Some((producer, topic.to_owned()));
        Ok(self)
    }

    /// How many records run at once (default 1). Above 1, a partition's records may finish
    /// out of order (its commit still waits for the lowest); at 1 they run in the
    /// partition's order, a failing record retried before the next starts.
    pub fn concurrency(mut self, records: usize) -> Self {
        self.concurrency = records.max(1);
        self
    }

    /// The underlying consumer, to read its assignment, pause it or read its metrics.
    pub fn consumer(&self) -> &StreamConsumer<GroupContext> {
        &self.inner.consumer
    }

    /// Runs every record through `handle` (which settles it, as
    /// [`Consumer::handle`](super::Consumer::handle) and
    /// [`Consumer::inbox`](super::Consumer::inbox) do, and returns the disposition) until
    /// a settlement fails.
    ///
    /// # Errors
    ///
    /// The first settlement that failed (the dead-letter topic did not take a record):
    /// the records running then are dropped (a dropped claim is released), and their
    /// offsets are not stored.
    pub async fn run<F, Fut>(&self, handle: F) -> Result<(), BoxError>
    where
        F: Fn(KafkaRecord) -> Fut,
        Fut: Future<Output = Result<Disposition, BoxError>>,
    {
        self.run_until(std::future::pending(), handle).await
    }

    /// [`run`](Self::run) until `stop` resolves, then starts no other record, lets the
    /// running ones finish, and commits the stored offsets before it returns. However a run
    /// ends (this, an error, a drop), the next one reads each partition again from the
    /// first record this one read and did not finish. A group runs one `run` at a time:
    /// clones share its member.
    ///
    /// # Errors
    ///
    /// As [`run`](Self::run), and the final commit's. [`Error::Config`] when an earlier
    /// run could not move a partition back to its first unfinished record (librdkafka
    /// refused the seek): this member would read past records nobody ran, so it refuses;
    /// join the group anew.
    pub async fn run_until<S, F, Fut>(&self, stop: S, handle: F) -> Result<(), BoxError>
    where
        S: Future<Output = ()>,
        F: Fn(KafkaRecord) -> Fut,
        Fut: Future<Output = Result<Disposition, BoxError>>,
    {
        let handle = &handle;
        if self.inner.lost.load(Ordering::Acquire) {
            return Err(Error::config(
                "an earlier run of this Kafka group member left records it could not read again: join the group anew",
            )
            .into());
        }
        // However this ends (an error, a drop), what it read and did not finish is read
        // again by the next run.
        let mut run = Run {
            group: self,
            waiting: VecDeque::new(),
            paused: false,
        };
        let mut running = FuturesUnordered::new();
        let mut stop = std::pin::pin!(stop);
        let mut stopping = false;
        loop {
            // A stop that came while a record finished starts no other.
            if !stopping && stop.as_mut().now_or_never().is_some() {
                stopping = true;
            }
            if !stopping {
                while running.len() < self.concurrency {
                    let Some(record) = run.waiting.pop_front() else {
                        break;
                    };
                    self.inner.marks().start(&record.message, record.epoch);
                    running.push(attempts(handle, record));
                }
                if run.paused && run.waiting.is_empty() {
                    run.paused = self.pause(false);
                }
            }
            tokio::select! {
                biased;
                () = &mut stop, if !stopping => stopping = true,
                Some(finished) = running.next() => {
                    let record: KafkaRecord = finished?;
                    let offset = self.inner.marks().finish(&record.message, record.epoch);
                    self.inner.consumer.context().progressed();
                    if self.inner.owns(&record) {
                        self.store(&record.message, offset);
                    }
                    if record.dead_lettered.swap(false, Ordering::AcqRel) {
                        // What was dead-lettered is not read again, bar a death right here.
                        if let Err(err) = self.commit().await {
                            tracing::warn!(error = %err, "a Kafka commit after a dead letter failed");
                        }
                        self.inner.rejecting.fetch_sub(1, Ordering::AcqRel);
                    }
                }
                // Polled even while `concurrency` records run, so that the member serves its
                // group's rebalances and stays in it however slow a handler is: what comes
                // then waits, and once `AHEAD` records wait the partitions are paused until
                // they have all started (a pause drops librdkafka's prefetched records: it
                // is for a handler that falls behind, not for every record).
                received = self.receive(), if !stopping => match received {
                    Ok(message) => {
                        run.waiting.push_back(KafkaRecord::new(&self.inner, message));
                        if run.waiting.len() >= AHEAD && !run.paused {
                            run.paused = self.pause(true);
                        }
                    }
                    // librdkafka recovers from what it reports here (a broker down, a
                    // rebalance under way) on its own.
                    Err(err) => tracing::warn!(error = %err, "a Kafka consumer's poll failed"),
                },
                else => break,
            }
        }
        self.commit().await?;
        Ok(())
    }

    /// The next record (serving the group's rebalances meanwhile), once no dead-lettered
    /// record waits for its commit.
    async fn receive(&self) -> Result<OwnedMessage, rdkafka::error::KafkaError> {
        let mut next = std::pin::pin!(self.inner.consumer.recv());
        // Asked on every poll: a record polled in the same task may start a dead letter
        // between two. The record's end wakes the task again.
        let message = std::future::poll_fn(|cx| {
            if self.inner.rejecting.load(Ordering::Acquire) > 0 {
                return std::task::Poll::Pending;
            }
            next.as_mut().poll(cx)
        })
        .await?;
        Ok(message.detach())
    }

    /// Pauses (or resumes) fetching from the member's assigned partitions: whether they are
    /// paused now. A failure is logged: the records that come meanwhile wait in memory.
    fn pause(&self, pause: bool) -> bool {
        let consumer = &self.inner.consumer;
        let done = consumer.assignment().and_then(|assigned| {
            if pause {
                consumer.pause(&assigned)
            } else {
                consumer.resume(&assigned)
            }
        });
        match done {
            Ok(()) => pause,
            Err(err) => {
                tracing::warn!(error = %err, pause, "a Kafka consumer's partitions could not be paused or resumed");
                !pause
            }
        }
    }

    /// Commits the stored offsets now, and waits for the broker's answer.
    async fn commit(&self) -> Result<(), BoxError> {
        let consumer = self.clone();
        let committed = tokio::task::spawn_blocking(move || {
            consumer
                .inner
                .consumer
                .commit_consumer_state(CommitMode::Sync)
        })
        .await
        .map_err(|err| Error::store(err.to_string()))?;
        match committed {
            // Nothing stored since the last commit.
            Err(err) if err.rdkafka_error_code() == Some(RDKafkaErrorCode::NoOffset) => Ok(()),
            other => Ok(other?),
        }
    }

    /// Stores `offset` (the partition's watermark) as `message`'s partition's next commit,
    /// unless the partition was revoked while the record ran: its new owner commits it.
    fn store(&self, message: &OwnedMessage, offset: i64) {
        let mut offsets = TopicPartitionList::new();
        let stored = offsets
            .add_partition_offset(message.topic(), message.partition(), Offset::Offset(offset))
            .and_then(|()| self.inner.consumer.store_offsets(&offsets));
        if let Err(err) = stored {
            tracing::debug!(topic = message.topic(), partition = message.partition(), error = %err,
                "an offset was not stored: the partition is no longer this consumer's");
        }
    }
}

/// A run's records read and not started, and what its end leaves behind however it ends
/// (its last record, an error, a drop): each partition still the member's is read again
/// from the first record the run read and did not finish (a record dropped mid-run, or
/// one that waited), that record and those after it hold no watermark, and paused
/// partitions are resumed. Without it the next run would read on past them, and store
/// offsets past records nobody ran.
struct Run<'a> {
    group: &'a KafkaGroup,
    /// Records read while `concurrency` run, in the order they came.
    waiting: VecDeque<KafkaRecord>,
    /// Whether the run paused the member's partitions.
    paused: bool,
}

impl Drop for Run<'_> {
    fn drop(&mut self) {
        let group = &self.group.inner;
        let marks = std::mem::take(&mut *group.marks());
        group.rejecting.store(0, Ordering::Release);
        let context = group.consumer.context();
        let started = marks
            .partitions
            .iter()
            .filter_map(|((topic, partition), epochs)| {
                let epoch = context.epoch(topic, *partition)?;
                let first = *epochs.get(&epoch)?.running.keys().next()?;
                Some((topic.as_str(), *partition, first))
            });
        let waited = self
            .waiting
            .iter()
            .filter(|record| group.owns(record))
            .map(|record| {
                let message = &record.message;
                (message.topic(), message.partition(), message.offset())
            });
        let mut first = HashMap::<(&str, i32), i64>::new();
        for (topic, partition, offset) in started.chain(waited) {
            first
                .entry((topic, partition))
                .and_modify(|first| *first = (*first).min(offset))
                .or_insert(offset);
        }
        for ((topic, partition), offset) in first {
            let sought =
                group
                    .consumer
                    .seek(topic, partition, Offset::Offset(offset), SEEK_TIMEOUT);
            if let Err(err) = sought {
                // The next run would read past it: it refuses instead.
                group.lost.store(true, Ordering::Release);
                tracing::error!(topic, partition, offset, error = %err,
                    "a Kafka partition could not be read again from a run's first unfinished record");
            }
        }
        if self.paused {
            self.group.pause(false);
        }
    }
}

/// Settings of a consumer's config that its dead-letter producer shares: where the cluster
/// is and how to reach it.
fn is_shared_setting(name: &str) -> bool {
    name == "bootstrap.servers"
        || name == "client.id"
        || name.starts_with("security.")
        || name.starts_with("ssl.")
        || name.starts_with("sasl.")
}

/// Runs `record` through `handle` until it is settled for good: a requeue (whose delay the
/// settlement waited) is another attempt.
async fn attempts<F, Fut>(handle: &F, mut record: KafkaRecord) -> Result<KafkaRecord, BoxError>
where
    F: Fn(KafkaRecord) -> Fut,
    Fut: Future<Output = Result<Disposition, BoxError>>,
{
    while let Disposition::Requeue { .. } = handle(record.clone()).await? {
        record.attempt += 1;
    }
    Ok(record)
}

/// Each partition's running records by epoch, and the offset below which all an epoch
/// read is finished.
#[derive(Default)]
struct Watermarks {
    partitions: HashMap<(String, i32), BTreeMap<u64, Partition>>,
}

#[derive(Default)]
struct Partition {
    /// The running records' offsets.
    running: BTreeMap<i64, usize>,
    /// One past the highest offset started.
    next: i64,
}

impl Watermarks {
    fn start(&mut self, message: &OwnedMessage, epoch: u64) {
        let epochs = self
            .partitions
            .entry((message.topic().to_owned(), message.partition()))
            .or_default();
        // Earlier epochs with nothing running are over.
        epochs.retain(|other, partition| *other == epoch || !partition.running.is_empty());
        let partition = epochs.entry(epoch).or_default();
        *partition.running.entry(message.offset()).or_default() += 1;
        partition.next = partition.next.max(message.offset() + 1);
    }

    /// The lowest offset running in `message`'s partition in `epoch`.
    fn lowest(&self, message: &OwnedMessage, epoch: u64) -> Option<i64> {
        let key = (message.topic().to_owned(), message.partition());
        let partition = self.partitions.get(&key)?.get(&epoch)?;
        partition.running.keys().next().copied()
    }

    /// Marks `message` (read in `epoch`) finished, and returns its partition's watermark in
    /// that epoch: the lowest offset still running, or one past the highest started when
    /// none runs.
    fn finish(&mut self, message: &OwnedMessage, epoch: u64) -> i64 {
        let key = (message.topic().to_owned(), message.partition());
        let partition = self
            .partitions
            .entry(key)
            .or_default()
            .entry(epoch)
            .or_default();
        if let Some(count) = partition.running.get_mut(&message.offset()) {
            *count -= 1;
            if *count == 0 {
                partition.running.remove(&message.offset());
            }
        }
        partition
            .running
            .keys()
            .next()
            .copied()
            .unwrap_or(partition.next)
    }
}

/// A record as a [`KafkaGroup`] hands it to its handler: a [`Delivery`] whose id is its
/// coordinates (with the cluster and group), whose deliveries are this consumer's attempts
/// at it, and whose reject sends it to the dead-letter topic. Cheap to clone.
#[derive(Clone)]
pub struct KafkaRecord {
    message: Arc<OwnedMessage>,
    group: Arc<Group>,
    coordinates: Arc<str>,
    attempt: u64,
    /// The epoch of its partition it was read in (0: none, never current).
    epoch: u64,
    /// Whether it was dead-lettered and its offset is not committed yet.
    dead_lettered: Arc<AtomicBool>,
}

impl std::fmt::Debug for KafkaRecord {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaRecord")
            .field("coordinates", &self.coordinates)
            .field("attempt", &self.attempt)
            .finish_non_exhaustive()
    }
}

impl KafkaRecord {
    fn new(group: &Arc<Group>, message: OwnedMessage) -> Self {
        let coordinates = format!(
            "{}/{}/{}/{}/{}",
            group.cluster,
            group.group,
            message.topic(),
            message.partition(),
            message.offset()
        );
        let epoch = group
            .consumer
            .context()
            .epoch(message.topic(), message.partition())
            .unwrap_or(0);
        Self {
            message: Arc::new(message),
            group: Arc::clone(group),
            coordinates: coordinates.into(),
            attempt: 1,
            epoch,
            dead_lettered: Arc::default(),
        }
    }

    /// The record as rdkafka read it: its key, timestamp, topic, partition and offset.
    pub fn message(&self) -> &OwnedMessage {
        &self.message
    }

    /// Waits until every record read before this one in its partition is finished, so that
    /// the commit right after its dead letter passes it: a member that dies before then
    /// has sent no dead letter, and the partition's next reader sends it. False if the
    /// partition moved meanwhile.
    async fn first_unfinished(&self) -> bool {
        let mut progress = self.group.consumer.context().progress.subscribe();
        loop {
            if !self.group.owns(self) {
                return false;
            }
            let lowest = self.group.marks().lowest(&self.message, self.epoch);
            if lowest == Some(self.message.offset()) {
                return true;
            }
            if progress.changed().await.is_err() {
                return false;
            }
        }
    }

    /// The record's dead letter: its key, payload and headers, and where it came from.
    fn dead_letter_headers(&self) -> OwnedHeaders {
        let mut headers = self.message.headers().cloned().unwrap_or_default();
        let partition = self.message.partition().to_string();
        let offset = self.message.offset().to_string();
        for (key, value) in [
            ("idem-source-cluster", self.group.cluster.as_str()),
            ("idem-source-topic", self.message.topic()),
            ("idem-source-partition", &partition),
            ("idem-source-offset", &offset),
        ] {
            headers = headers.insert(Header {
                key,
                value: Some(value),
            });
        }
        headers
    }
}

#[crate::async_trait]
impl Delivery for KafkaRecord {
    fn payload(&self) -> &[u8] {
        self.message.payload().unwrap_or_default()
    }

    fn message_id(&self) -> Option<Cow<'_, str>> {
        Some(Cow::Borrowed(&self.coordinates))
    }

    /// The last header `name` (Kafka allows repeats, and a later one overrides), if its
    /// value is text.
    fn header(&self, name: &str) -> Option<Cow<'_, str>> {
        let headers = self.message.headers()?;
        let found = headers.iter().filter(|header| header.key == name).last()?;
        std::str::from_utf8(found.value?).ok().map(Cow::Borrowed)
    }

    fn deliveries(&self) -> Option<u64> {
        Some(self.attempt)
    }

    async fn settle(&self, disposition: Disposition) -> Result<(), BoxError> {
        match disposition {
            // The group stores the offset once every record below it is finished.
            Disposition::Ack => {}
            Disposition::Requeue { after } => tokio::time::sleep(after).await,
            // Its partition moved since it was read: the new reader reads it again from the
            // last commit, below it, and dead-letters it.
            Disposition::Reject if !self.group.owns(self) => tracing::info!(
                record = %self.coordinates,
                "a rejected Kafka record's partition moved: its new reader dead-letters it"
            ),
            Disposition::Reject => match &self.group.dead_letter {
                // Its partition moved while it waited for the records before it.
                Some(_) if !self.first_unfinished().await => tracing::info!(
                    record = %self.coordinates,
                    "a rejected Kafka record's partition moved: its new reader dead-letters it"
                ),
                Some((producer, topic)) => {
                    let mut record = FutureRecord::to(topic)
                        .payload(self.payload())
                        .headers(self.dead_letter_headers());
                    if let Some(key) = self.message.key() {
                        record = record.key(key);
                    }
                    // No rebalance is served from here until its offset is committed.
                    self.group.rejecting.fetch_add(1, Ordering::AcqRel);
                    // One at a time, in the order the records were rejected.
                    let turn = self.group.dead_letters.lock().await;
                    let sent = producer.send(record, Duration::from_secs(30)).await;
                    drop(turn);
                    if let Err((err, _)) = sent {
                        self.group.rejecting.fetch_sub(1, Ordering::AcqRel);
                        return Err(err.into());
                    }
                    self.dead_lettered.store(true, Ordering::Release);
                }
                None => tracing::error!(
                    record = %self.coordinates,
                    "a rejected Kafka record is skipped: its group has no dead-letter topic"
                ),
            },
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(topic: &str, partition: i32, offset: i64) -> OwnedMessage {
        OwnedMessage::new(
            None,
            None,
            topic.to_owned(),
            rdkafka::Timestamp::NotAvailable,
            partition,
            offset,
            None,
        )
    }

    #[test]
    fn the_watermark_never_passes_a_running_record() {
        let mut marks = Watermarks::default();
        let (a, b, c) = (
            message("t", 0, 10),
            message("t", 0, 11),
            message("t", 0, 12),
        );
        for running in [&a, &b, &c] {
            marks.start(running, 1);
        }
        // 12 and 11 finish before 10: nothing past 10 is stored.
        assert_eq!(marks.finish(&c, 1), 10);
        assert_eq!(marks.finish(&b, 1), 10);
        assert_eq!(marks.finish(&a, 1), 13);
        // Partitions and topics are apart.
        let other = message("t", 1, 3);
        marks.start(&other, 1);
        marks.start(&message("u", 0, 50), 1);
        assert_eq!(marks.finish(&other, 1), 4);
    }

    #[test]
    fn an_epoch_counts_only_its_own_records() {
        let mut marks = Watermarks::default();
        let old = message("t", 0, 7);
        marks.start(&old, 1);
        marks.start(&message("t", 0, 8), 1);
        // Revoked and assigned again from the last commit, 7: 7 runs in both epochs.
        let again = message("t", 0, 7);
        marks.start(&again, 2);
        assert_eq!(
            marks.finish(&again, 2),
            8,
            "the old epoch's 7 and 8 hold nothing back"
        );
        assert_eq!(marks.finish(&old, 1), 8, "8 still runs in the old epoch");
        // An idle old epoch is dropped when its partition starts a record again.
        marks.finish(&message("t", 0, 8), 1);
        marks.start(&message("t", 0, 9), 2);
        assert_eq!(marks.partitions[&("t".to_owned(), 0)].len(), 1);
    }
}
