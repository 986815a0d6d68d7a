//! `consumer::sqs` against moto's SQS server (a second implementation nobody here wrote):
//! each message handled once and deleted after its record, a duplicate replayed, a poison
//! and a reused id sent to the redrive policy's dead-letter queue once; a handler slower
//! than the visibility timeout keeps its message; a transient failure comes back after its
//! backoff and is dead-lettered after the last delivery; a FIFO group stays in order.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use aws_sdk_sqs::types::{MessageAttributeValue, QueueAttributeName};
use aws_sdk_sqs::Client;
use idem_runtime::consumer::sqs::{SqsMessage, SqsQueue};
use idem_runtime::consumer::{Consumer, Delivery, Disposition, MessageId};
use idem_runtime::{Error, MemoryStore};
use idem_tests::{sqs_client, sqs_endpoint};
use tokio::sync::Notify;

/// A queue of this test's own and its dead-letter queue (redriven after 5 receives), with
/// `visibility` seconds of visibility timeout.
async fn queue(client: &Client, name: &str, fifo: bool, visibility: u32) -> SqsQueue {
    let suffix = if fifo { ".fifo" } else { "" };
    let run = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let create = |name: String, attributes: Vec<(QueueAttributeName, String)>| {
        let mut request = client.create_queue().queue_name(name);
        if fifo {
            request = request.attributes(QueueAttributeName::FifoQueue, "true");
        }
        for (attribute, value) in attributes {
            request = request.attributes(attribute, value);
        }
        async move { request.send().await.unwrap().queue_url.unwrap() }
    };
    let dead = create(format!("{name}-{run}-dead{suffix}"), Vec::new()).await;
    let arn = client
        .get_queue_attributes()
        .queue_url(&dead)
        .attribute_names(QueueAttributeName::QueueArn)
        .send()
        .await
        .unwrap()
        .attributes
        .unwrap()
        .remove(&QueueAttributeName::QueueArn)
        .unwrap();
    let policy = format!(r#"{{"deadLetterTargetArn":"{arn}","maxReceiveCount":"5"}}"#);
    let url = create(
        format!("{name}-{run}{suffix}"),
        vec![
            (QueueAttributeName::RedrivePolicy, policy),
            (
                QueueAttributeName::VisibilityTimeout,
                visibility.to_string(),
            ),
        ],
    )
    .await;
    let queue = SqsQueue::connect(client.clone(), url).await.unwrap();
    assert_eq!(queue.dead_letter_url(), Some(dead.as_str()));
    assert_eq!(queue.is_fifo(), fifo);
    assert_eq!(
        queue.visibility_timeout(),
        Duration::from_secs(visibility.into())
    );
    queue
}

async fn send(client: &Client, queue: &SqsQueue, body: &str, order_id: Option<&str>) {
    let mut request = client
        .send_message()
        .queue_url(queue.url())
        .message_body(body);
    if let Some(id) = order_id {
        let attribute = MessageAttributeValue::builder()
            .data_type("String")
            .string_value(id)
            .build()
            .unwrap();
        request = request.message_attributes("order-id", attribute);
    }
    request.send().await.unwrap();
}

async fn send_fifo(client: &Client, queue: &SqsQueue, body: &str, group: &str, id: &str) {
    client
        .send_message()
        .queue_url(queue.url())
        .message_body(body)
        .message_group_id(group)
        .message_deduplication_id(id)
        .send()
        .await
        .unwrap();
}

/// The bodies of every message in the queue at `url`, taken.
async fn take_all(client: &Client, url: &str) -> Vec<String> {
    let mut bodies = Vec::new();
    loop {
        let output = client
            .receive_message()
            .queue_url(url)
            .max_number_of_messages(10)
            .send()
            .await
            .unwrap();
        let messages = output.messages.unwrap_or_default();
        if messages.is_empty() {
            return bodies;
        }
        for message in messages {
            client
                .delete_message()
                .queue_url(url)
                .receipt_handle(message.receipt_handle.unwrap())
                .send()
                .await
                .unwrap();
            bodies.push(message.body.unwrap());
        }
    }
}

/// How many messages the queue holds, visible or not.
async fn held(client: &Client, queue: &SqsQueue) -> u64 {
    let attributes = client
        .get_queue_attributes()
        .queue_url(queue.url())
        .attribute_names(QueueAttributeName::ApproximateNumberOfMessages)
        .attribute_names(QueueAttributeName::ApproximateNumberOfMessagesNotVisible)
        .send()
        .await
        .unwrap()
        .attributes
        .unwrap();
    attributes.values().map(|n| n.parse::<u64>().unwrap()).sum()
}

/// Receives and handles with `handle` until `done` says so (bounded: a minute).
async fn consume<F, Fut>(queue: &SqsQueue, mut done: impl FnMut() -> bool, mut handle: F)
where
    F: FnMut(SqsMessage) -> Fut,
    Fut: std::future::Future<Output = Result<Disposition, idem_runtime::BoxError>>,
{
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while !done() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "not done within a minute"
        );
        let batch = queue.receive(10, Duration::from_secs(1)).await.unwrap();
        queue.in_order(batch, &mut handle).await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_message_runs_once_and_bad_ones_are_dead_lettered_once() {
    let Some(url) = sqs_endpoint().await else {
        return;
    };
    let client = sqs_client(&url);
    let queue = queue(&client, "idem-once", false, 30).await;
    for n in 0..6 {
        let body = format!(r#"{{"order":{n}}}"#);
        send(&client, &queue, &body, Some(&format!("o-{n}"))).await;
        if n % 2 == 0 {
            // Sent again, as a producer that retried its send: a new SQS message id.
            send(&client, &queue, &body, Some(&format!("o-{n}"))).await;
        }
    }
    send(&client, &queue, "{not json", Some("o-poison")).await;
    send(&client, &queue, r#"{"order":999}"#, Some("o-1")).await;
    send(&client, &queue, r#"{"order":7}"#, None).await;

    let consumer = Consumer::new("sqs.once")
        .store(MemoryStore::new())
        .message_id(MessageId::header("order-id"));
    let runs = Mutex::new(BTreeMap::<u64, u32>::new());
    let settled = Mutex::new(Vec::new());
    #[derive(serde::Deserialize)]
    struct Order {
        order: u64,
    }
    consume(
        &queue,
        || settled.lock().unwrap().len() == 12,
        |message| {
            let (consumer, runs, settled) = (&consumer, &runs, &settled);
            async move {
                let disposition = consumer
                    .handle(&message, |order: Order| async move {
                        *runs.lock().unwrap().entry(order.order).or_default() += 1;
                        Ok::<_, Error>(order.order)
                    })
                    .await?;
                settled.lock().unwrap().push(disposition);
                Ok(disposition)
            }
        },
    )
    .await;

    let runs = runs.into_inner().unwrap();
    assert_eq!(runs, (0..6).map(|n| (n, 1)).collect(), "each order once");
    let settled = settled.into_inner().unwrap();
    let acks = settled.iter().filter(|d| **d == Disposition::Ack).count();
    assert_eq!(acks, 9, "six orders and three duplicates: {settled:?}");
    assert_eq!(held(&client, &queue).await, 0, "every message deleted");
    let mut dead = take_all(&client, queue.dead_letter_url().unwrap()).await;
    dead.sort();
    assert_eq!(
        dead,
        [r#"{"order":7}"#, r#"{"order":999}"#, "{not json"],
        "the message without an id, the reused id and the poison, once each"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_slower_than_the_visibility_timeout_keeps_its_message() {
    let Some(url) = sqs_endpoint().await else {
        return;
    };
    let client = sqs_client(&url);
    let queue = queue(&client, "idem-slow", false, 3).await;
    send(&client, &queue, "1", None).await;
    let consumer = Consumer::new("sqs.slow").store(MemoryStore::new());

    let mut batch = queue.receive(1, Duration::from_secs(5)).await.unwrap();
    let message = batch.pop().expect("the message");
    let started = Arc::new(Notify::new());
    let release = Arc::new(Notify::new());
    let handling = {
        let (started, release) = (started.clone(), release.clone());
        let consumer = consumer.clone();
        tokio::spawn(async move {
            consumer
                .handle(&message, |n: u32| async move {
                    started.notify_one();
                    release.notified().await;
                    Ok::<_, Error>(n)
                })
                .await
                .unwrap()
        })
    };
    started.notified().await;
    // Another consumer polls for three visibility timeouts while the handler works: a
    // message whose visibility was not renewed would come back to it.
    let polled_since = tokio::time::Instant::now();
    let mut stolen = Vec::new();
    while polled_since.elapsed() < 3 * queue.visibility_timeout() {
        stolen.extend(queue.receive(10, Duration::from_secs(1)).await.unwrap());
    }
    release.notify_one();
    assert_eq!(handling.await.unwrap(), Disposition::Ack);
    assert!(
        stolen.is_empty(),
        "delivered again while its handler ran: {:?}",
        stolen.iter().map(|m| m.deliveries()).collect::<Vec<_>>()
    );
    assert_eq!(held(&client, &queue).await, 0, "deleted after the record");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transient_failure_comes_back_after_its_backoff_until_the_last_delivery() {
    let Some(url) = sqs_endpoint().await else {
        return;
    };
    let client = sqs_client(&url);
    let queue = queue(&client, "idem-transient", false, 30).await;
    send(&client, &queue, r#""flaky""#, Some("flaky")).await;
    send(&client, &queue, r#""down""#, Some("down")).await;
    let consumer = Consumer::new("sqs.transient")
        .store(MemoryStore::new())
        .message_id(MessageId::header("order-id"))
        .backoff(Duration::from_secs(1), Duration::from_secs(1))
        .max_deliveries(3);
    // Each delivery's count as the handler saw it, by message.
    let seen = Mutex::new(BTreeMap::<String, Vec<(u64, Disposition)>>::new());
    let finished = || {
        let seen = seen.lock().unwrap();
        let last = |id: &str| seen.get(id).and_then(|d| d.last()).map(|(_, d)| *d);
        last("flaky") == Some(Disposition::Ack) && last("down") == Some(Disposition::Reject)
    };
    consume(&queue, finished, |message| {
        let (consumer, seen) = (&consumer, &seen);
        async move {
            let deliveries = message.deliveries().unwrap();
            let disposition = consumer
                .handle(&message, |what: String| async move {
                    match what.as_str() {
                        "flaky" if deliveries < 2 => Err(Error::store("flaky, once")),
                        "flaky" => Ok(what),
                        _ => Err(Error::store("always down")),
                    }
                })
                .await?;
            let id = message.header("order-id").unwrap().into_owned();
            seen.lock()
                .unwrap()
                .entry(id)
                .or_default()
                .push((deliveries, disposition));
            Ok(disposition)
        }
    })
    .await;

    let seen = seen.into_inner().unwrap();
    let backoff = Disposition::Requeue {
        after: Duration::from_secs(1),
    };
    assert_eq!(seen["flaky"], [(1, backoff), (2, Disposition::Ack)]);
    assert_eq!(
        seen["down"],
        [(1, backoff), (2, backoff), (3, Disposition::Reject)],
        "rejected on the consumer's last delivery, before the redrive policy's"
    );
    assert_eq!(held(&client, &queue).await, 0);
    let dead = take_all(&client, queue.dead_letter_url().unwrap()).await;
    assert_eq!(dead, [r#""down""#], "dead-lettered once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fifo_group_is_handled_in_order_behind_a_failure() {
    let Some(url) = sqs_endpoint().await else {
        return;
    };
    let client = sqs_client(&url);
    let queue = queue(&client, "idem-fifo", true, 30).await;
    for (body, group) in [("a1", "a"), ("a2", "a"), ("b1", "b"), ("a3", "a")] {
        send_fifo(&client, &queue, &format!(r#""{body}""#), group, body).await;
    }
    let consumer = Consumer::new("sqs.fifo")
        .store(MemoryStore::new())
        .backoff(Duration::from_secs(1), Duration::from_secs(1));
    let failed_once = AtomicBool::new(false);
    let order = Mutex::new(Vec::new());
    let acked = Mutex::new(Vec::new());
    consume(
        &queue,
        || acked.lock().unwrap().len() == 4,
        |message| {
            let (consumer, failed_once, order, acked) = (&consumer, &failed_once, &order, &acked);
            async move {
                let id = message.message_id().unwrap().into_owned();
                let disposition = consumer
                    .handle(&message, |body: String| async move {
                        order.lock().unwrap().push(body.clone());
                        if body == "a1" && !failed_once.swap(true, Ordering::SeqCst) {
                            return Err(Error::store("a1 fails once"));
                        }
                        Ok::<_, Error>(body)
                    })
                    .await?;
                if disposition == Disposition::Ack {
                    acked.lock().unwrap().push(id);
                }
                Ok(disposition)
            }
        },
    )
    .await;

    let order = order.into_inner().unwrap();
    let group_a: Vec<&str> = order
        .iter()
        .map(String::as_str)
        .filter(|body| body.starts_with('a'))
        .collect();
    assert_eq!(
        group_a,
        ["a1", "a1", "a2", "a3"],
        "group a in order: {order:?}"
    );
    assert_eq!(
        order.iter().filter(|body| *body == "b1").count(),
        1,
        "{order:?}"
    );
    assert_eq!(held(&client, &queue).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fifo_dead_letter_queue_takes_a_rejected_message_once() {
    let Some(url) = sqs_endpoint().await else {
        return;
    };
    let client = sqs_client(&url);
    let queue = queue(&client, "idem-fifo-dead", true, 30).await;
    send_fifo(&client, &queue, "{not json", "g", "poison").await;
    let message = queue
        .receive(1, Duration::from_secs(5))
        .await
        .unwrap()
        .pop()
        .expect("the message");
    // A consumer that died between its send to the dead-letter queue and its delete: the
    // message is rejected again, by the same id.
    let died = message.clone();
    message.settle(Disposition::Reject).await.unwrap();
    let _ = died.settle(Disposition::Reject).await;
    let dead = take_all(&client, queue.dead_letter_url().unwrap()).await;
    assert_eq!(dead, ["{not json"], "the second send is deduplicated");
    assert_eq!(held(&client, &queue).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queue_without_visibility_has_no_lease_to_renew() {
    let Some(url) = sqs_endpoint().await else {
        return;
    };
    let client = sqs_client(&url);
    let queue = queue(&client, "idem-no-visibility", false, 0).await;
    send(&client, &queue, "1", None).await;
    let message = queue
        .receive(1, Duration::from_secs(5))
        .await
        .unwrap()
        .pop()
        .expect("the message");
    assert_eq!(message.lease(), None);
    let visible = queue
        .receive(1, Duration::from_secs(5))
        .await
        .unwrap()
        .pop();
    assert_eq!(
        visible.and_then(|m| m.deliveries()),
        Some(2),
        "visible again at once: nothing to renew"
    );
}
