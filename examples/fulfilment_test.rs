//! The fulfilment service (`fulfilment.rs`) as its senders meet it: two instances on one
//! Redis and one PostgreSQL, both pulling from one JetStream consumer, SIGKILLed more than
//! fifty times, the victim each time with webhook deliveries stalled after their commit
//! and orders stalled after their payment's capture (before their commit) or after their
//! commit (before their ack); the senders resend what was not answered `2xx`, the broker
//! redelivers what was not acked. Every delivery has its effect once, every order ships
//! once and is captured once, nothing is lost, nothing is left unacked.

#[path = "fulfilment.rs"]
#[allow(dead_code)]
mod fulfilment;
#[path = "process.rs"]
mod process;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

use async_nats::jetstream::consumer::pull;
use fulfilment::{Config, Order, Sender, Sponsorship, Stall, UserEvent};
use process::Service;

/// Rounds of the test: each kills the stalled victim and then the other instance.
const ROUNDS: usize = 26;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "an instance, started (and killed) by two_instances_killed_fifty_times_have_every_effect_once"]
async fn fulfilment_instance() {
    let addr: SocketAddr = std::env::var("IDEM_FULFILMENT_ADDR")
        .unwrap()
        .parse()
        .unwrap();
    let listener = tokio::net::TcpListener::bind(addr).await.unwrap();
    fulfilment::serve(listener, Config::from_env(), process::stdin_closed())
        .await
        .unwrap();
}

/// An instance on `addr`, honouring stall marks if `stall`, once it listens.
async fn instance(addr: SocketAddr, config: &Config, stall: bool) -> Service {
    let mut env = vec![
        ("IDEM_FULFILMENT_ADDR", addr.to_string()),
        ("IDEM_FULFILMENT_STREAM", config.stream.clone()),
        ("IDEM_PAYMENTS_URL", config.payments_url.clone()),
    ];
    if stall {
        env.push(("IDEM_FULFILMENT_STALL", "1".into()));
    }
    let mut service = Service::start("fulfilment_instance", &env);
    service.said("listening").await;
    service
}

fn required(what: &str, err: impl std::fmt::Display) {
    assert!(
        std::env::var_os("IDEM_REQUIRE_SERVICES").is_none(),
        "{what} is required (IDEM_REQUIRE_SERVICES): {err}"
    );
    eprintln!("skipped: {what} is unreachable ({err})");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_killed_fifty_times_have_every_effect_once() {
    let mut config = Config::from_env();
    let pool = match sqlx::PgPool::connect(&config.postgres_url).await {
        Ok(pool) => pool,
        Err(err) => return required("PostgreSQL", err),
    };
    if let Err(err) = idem_runtime::RedisStore::connect(&config.redis_url).await {
        return required("Redis", err);
    }
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let run = format!("kill{}x{nanos}", std::process::id());
    config.stream = run.to_uppercase();
    let js = match fulfilment::stream(&config.nats_url, &config.stream).await {
        Ok(js) => js,
        Err(err) => return required("NATS JetStream", err),
    };
    fulfilment::tables(&pool).await.unwrap();
    let (payments, captures) = fulfilment::payments::api();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    config.payments_url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, payments).await });

    let addrs = [process::free_addr(), process::free_addr()];

    // First, one instance alone: killed after an order's capture, before its commit. The
    // redelivery, in the instance that takes its place, captures under the same key (derived
    // from the order's claim), and the API replays: one capture, two requests.
    let captured_then_killed = format!("{run}-order-alone");
    let mut alone = instance(addrs[0], &config, true).await;
    let order = Order {
        order: captured_then_killed.clone(),
        cents: 999,
        stall: Some(Stall::AfterCapture),
    };
    fulfilment::publish(&js, &config.stream, &order)
        .await
        .unwrap();
    alone.said("stalled AfterCapture").await;
    drop(alone);
    let mut kills = 1;
    let mut taker = instance(addrs[0], &config, false).await;
    taker.said("settled Ack").await;
    {
        let seen = captures.lock().unwrap();
        let key = &seen.keys[&captured_then_killed];
        assert_eq!(
            (seen.captures[&captured_then_killed], seen.requests[key]),
            (1, 2),
            "one capture, its request sent twice under one key"
        );
    }
    taker.finish().await;
    let mut orders = vec![captured_then_killed];

    let mut instances = [
        Some(instance(addrs[0], &config, true).await),
        Some(instance(addrs[1], &config, false).await),
    ];
    let sender = Sender::default();
    let mut deliveries = Vec::new();
    for round in 0..ROUNDS {
        let (victim, steady) = (round % 2, 1 - round % 2);
        // Two deliveries to the victim, which stalls on each after its commit.
        let standard_id = format!("{run}-std-{round}");
        let event = UserEvent {
            kind: "user.created".into(),
            user: format!("user-{round}"),
            stall: Some(Stall::AfterCommit),
        };
        let delivery = format!("{run}-gh-{round}");
        let sponsorship = Sponsorship {
            sponsor: format!("{run}-sponsor-{round}"),
            cents: 100 + round as i64,
            stall: Some(Stall::AfterCommit),
        };
        let to_victim = addrs[victim];
        let first = {
            let (sender, id, event) = (sender.clone(), standard_id.clone(), event.clone());
            tokio::spawn(async move { sender.standard_once(to_victim, &id, &event).await })
        };
        let second = {
            let (sender, delivery, sponsorship) =
                (sender.clone(), delivery.clone(), sponsorship.clone());
            tokio::spawn(
                async move { sender.github_once(to_victim, &delivery, &sponsorship).await },
            )
        };
        // Orders for whichever instance pulls them: the victim stalls on the marked ones.
        let published: Vec<Order> = (0..4)
            .map(|n| Order {
                order: format!("{run}-order-{round}-{n}"),
                cents: 1_000 + n,
                stall: match n {
                    0 => Some(Stall::AfterCapture),
                    1 => Some(Stall::AfterCommit),
                    _ => None,
                },
            })
            .collect();
        for order in &published {
            fulfilment::publish(&js, &config.stream, order)
                .await
                .unwrap();
        }
        orders.extend(published.into_iter().map(|order| order.order));
        let doomed = instances[victim].as_mut().unwrap();
        doomed.said("stalled").await;
        doomed.said("stalled").await;
        // Killed after both commits, before either answer: the senders never hear back.
        instances[victim] = None;
        kills += 1;
        assert!(first.await.unwrap().is_err() && second.await.unwrap().is_err());
        // The senders resend to either instance until answered `2xx`: replays.
        let resent_standard = fulfilment::until_delivered(|n| {
            sender.standard_once(addrs[n as usize % 2], &standard_id, &event)
        });
        let resent_github = fulfilment::until_delivered(|n| {
            sender.github_once(addrs[n as usize % 2], &delivery, &sponsorship)
        });
        let (standard, github) = tokio::join!(resent_standard, resent_github);
        standard.expect("the Standard Webhooks delivery was answered 2xx");
        github.expect("the GitHub delivery was answered 2xx");
        deliveries.push(("notification", standard_id));
        deliveries.push(("credit", sponsorship.sponsor.clone()));
        // The victim back, steady; the other killed wherever it is, and back as the victim.
        instances[victim] = Some(instance(addrs[victim], &config, false).await);
        instances[steady] = None;
        kills += 1;
        instances[steady] = Some(instance(addrs[steady], &config, true).await);
    }

    // The instance started last stalls on marked orders, and nothing would kill it there:
    // killed once more, wherever it is, and back steady, so that every redelivery is taken
    // by an instance that settles it.
    let stalling = 1 - (ROUNDS - 1) % 2;
    instances[stalling] = None;
    kills += 1;
    instances[stalling] = Some(instance(addrs[stalling], &config, false).await);

    // Every order shipped and acked: redeliveries after the kills, taken by the survivors.
    // A kill after a commit leaves its message unacked until the broker redelivers it (its
    // ack wait) and a survivor replays the record and acks, so the wait is for the
    // broker's count as well as the database's.
    let mut consumer: async_nats::jetstream::consumer::Consumer<pull::Config> = js
        .get_stream(&config.stream)
        .await
        .unwrap()
        .get_consumer(fulfilment::CONSUMER)
        .await
        .unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    let (counts, info): (BTreeMap<(String, String), i64>, _) = loop {
        let counts = fulfilment::counts(&pool, &run).await.unwrap();
        let info = consumer.info().await.unwrap().clone();
        let shipped = counts
            .iter()
            .filter(|(kind, ..)| kind == "shipment")
            .count();
        let settled = info.num_pending == 0 && info.num_ack_pending == 0;
        if (shipped == orders.len() && settled) || tokio::time::Instant::now() > deadline {
            let counts = counts
                .into_iter()
                .map(|(kind, id, n)| ((kind, id), n))
                .collect();
            break (counts, info);
        }
        // Polling the database and the broker for the survivors' commits and acks: a wait
        // for them, not a timing.
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    for instance in instances.iter_mut() {
        instance.take().unwrap().finish().await;
    }

    let mut twice = Vec::new();
    let mut lost = Vec::new();
    for (kind, id) in deliveries
        .iter()
        .map(|(kind, id)| (kind.to_string(), id.clone()))
        .chain(orders.iter().map(|id| ("shipment".to_string(), id.clone())))
    {
        match counts.get(&(kind.clone(), id.clone())) {
            Some(1) => {}
            Some(n) => twice.push(format!("{kind} {id}: {n}")),
            None => lost.push(format!("{kind} {id}")),
        }
    }
    let captured: BTreeMap<String, u64> = captures
        .lock()
        .unwrap()
        .captures
        .iter()
        .filter(|(order, _)| order.starts_with(&run))
        .map(|(order, n)| (order.clone(), *n))
        .collect();
    let captured_twice: Vec<_> = captured.iter().filter(|(_, n)| **n > 1).collect();
    println!(
        "{kills} SIGKILLs of two instances: {} webhook deliveries, {} orders; {} effects twice, {} lost; {} payments captured, {} twice; {} messages left pending, {} unacked",
        deliveries.len(),
        orders.len(),
        twice.len(),
        lost.len(),
        captured.len(),
        captured_twice.len(),
        info.num_pending,
        info.num_ack_pending,
    );
    assert!(kills >= 50, "{kills} kills");
    assert!(twice.is_empty(), "effects twice: {twice:?}");
    assert!(lost.is_empty(), "effects lost: {lost:?}");
    assert!(
        captured_twice.is_empty(),
        "captured twice: {captured_twice:?}"
    );
    assert_eq!(
        captured.len(),
        orders.len(),
        "every order's payment captured"
    );
    assert_eq!(info.num_pending, 0, "left in the stream: {info:?}");
    assert_eq!(info.num_ack_pending, 0, "awaiting an ack: {info:?}");
    js.delete_stream(&config.stream).await.unwrap();
}
