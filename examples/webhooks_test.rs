//! The webhook receivers (`webhooks.rs`) as a sender meets them: two receiver processes on
//! one PostgreSQL database, one of them SIGKILLed with deliveries stalled before and after
//! their commit, while the sender resends everything it was not answered `2xx`; then
//! resends sent together to both. Every delivery is credited exactly once.

#[path = "process.rs"]
mod process;
#[path = "webhooks.rs"]
#[allow(dead_code)]
mod webhooks;

use std::collections::BTreeMap;
use std::net::SocketAddr;

use process::Service;
use webhooks::{Event, EventData, Sender, Stall};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a receiver, started (and killed) by resends_after_kills_and_concurrent_resends_credit_once"]
async fn webhooks_receiver() {
    let addr: SocketAddr = std::env::var("IDEM_WEBHOOKS_ADDR")
        .unwrap()
        .parse()
        .unwrap();
    webhooks::serve(addr, &webhooks::postgres_url())
        .await
        .unwrap();
}

/// A receiver on `addr`, stalling where its deliveries say if `stall`, once it listens.
async fn receiver(addr: SocketAddr, stall: bool) -> Service {
    let mut env = vec![("IDEM_WEBHOOKS_ADDR", addr.to_string())];
    if stall {
        env.push(("IDEM_WEBHOOKS_STALL", "1".to_string()));
    }
    let mut service = Service::start("webhooks_receiver", &env);
    service.said("listening").await;
    service
}

fn event(id: String, stall: Option<Stall>) -> Event {
    Event {
        id,
        kind: "charge.succeeded".into(),
        data: EventData {
            account: "acct_1".into(),
            cents: 100,
        },
        pending_webhooks: 1,
        stall,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resends_after_kills_and_concurrent_resends_credit_once() {
    let pool = match sqlx::PgPool::connect(&webhooks::postgres_url()).await {
        Ok(pool) => pool,
        Err(e) => {
            assert!(
                std::env::var_os("IDEM_REQUIRE_SERVICES").is_none(),
                "PostgreSQL is required (IDEM_REQUIRE_SERVICES): {e}"
            );
            eprintln!("skipped: PostgreSQL is unreachable ({e})");
            return;
        }
    };
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let run = format!("evt_{}_{nanos}", std::process::id());
    let (addr_a, addr_b) = (process::free_addr(), process::free_addr());
    let steady = receiver(addr_b, false).await;
    let (to_a, to_b) = (Sender::new(addr_a), Sender::new(addr_b));
    let mut sent = Vec::new();

    // Three times: deliveries stall in receiver A, before and after their commit; A is
    // SIGKILLed; the sender resends each twice at once to B until answered 2xx.
    let kills = 3;
    for round in 0..kills {
        let mut doomed = receiver(addr_a, true).await;
        let events: Vec<Event> = [Stall::BeforeCommit, Stall::AfterCommit]
            .into_iter()
            .cycle()
            .take(4)
            .enumerate()
            .map(|(i, stall)| event(format!("{run}_k{round}_{i}"), Some(stall)))
            .collect();
        for event in &events {
            let (to_a, event) = (to_a.clone(), event.clone());
            // Its answer never comes: the receiver dies first.
            tokio::spawn(async move { to_a.stripe_once(&event, webhooks::STRIPE_SECRET).await });
        }
        for _ in &events {
            doomed.said("stalled").await;
        }
        drop(doomed);
        let before: BTreeMap<String, i64> = webhooks::credits(&pool, &format!("{run}_k{round}_"))
            .await
            .unwrap()
            .into_iter()
            .map(|(_, delivery, count)| (delivery, count))
            .collect();
        for event in &events {
            let expected = i64::from(event.stall == Some(Stall::AfterCommit));
            assert_eq!(
                before.get(&event.id).copied().unwrap_or(0),
                expected,
                "{}: the kill {:?} left {expected} credit(s)",
                event.id,
                event.stall
            );
        }
        let resends = events
            .iter()
            .flat_map(|event| [event.clone(), event.clone()])
            .map(|event| {
                let to_b = to_b.clone();
                async move { to_b.stripe(&event).await }
            });
        for answer in futures_util::future::join_all(resends).await {
            answer.expect("a resend was answered 2xx");
        }
        sent.extend(events.into_iter().map(|e| e.id));
    }

    // Resends sent together, to both receivers.
    let other = receiver(addr_a, false).await;
    let events: Vec<Event> = (0..10)
        .map(|i| event(format!("{run}_c{i}"), None))
        .collect();
    let resends = events.iter().flat_map(|event| {
        (0..6).map(|n| {
            let sender = if n % 2 == 0 {
                to_a.clone()
            } else {
                to_b.clone()
            };
            let event = event.clone();
            async move { sender.stripe(&event).await }
        })
    });
    let answers = futures_util::future::join_all(resends).await;
    let mut bodies: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (answer, event) in answers.into_iter().zip(events.iter().flat_map(|e| [e; 6])) {
        bodies
            .entry(event.id.clone())
            .or_default()
            .push(answer.expect("a concurrent resend was answered 2xx"));
    }
    for (id, answers) in &bodies {
        assert!(
            answers.iter().all(|a| *a == answers[0]),
            "{id}: {answers:?}"
        );
    }
    sent.extend(events.into_iter().map(|e| e.id));

    // A forged delivery: 401, and nothing credited.
    let forged = event(format!("{run}_forged"), None);
    let answer = to_b.stripe_once(&forged, "whsec_guessed").await.unwrap();
    assert_eq!(answer.status(), 401);

    let ledger = webhooks::credits(&pool, &run).await.unwrap();
    let credited: BTreeMap<String, i64> = ledger.into_iter().map(|(_, d, c)| (d, c)).collect();
    for id in &sent {
        assert_eq!(
            credited.get(id),
            Some(&1),
            "{id} was credited {:?} time(s)",
            credited.get(id)
        );
    }
    assert_eq!(
        credited.len(),
        sent.len(),
        "credits of deliveries never sent: {credited:?}"
    );
    drop((steady, other));
}
