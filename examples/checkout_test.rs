//! The checkout chain (`checkout.rs`), 1000 checkouts: a client that retries through a
//! network that loses answers, a checkout service in its own process SIGKILLed at random
//! points and restarted, a shop and a gateway that count what they make. Every checkout
//! reserves, charges and orders exactly once and gets its own receipt.

#[path = "checkout.rs"]
mod checkout;

use std::process::Command;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "the checkout service, started (and killed) by every_checkout_happens_once_through_kills_and_a_faulty_network"]
async fn checkout_service() {
    checkout::serve_from_env().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_checkout_happens_once_through_kills_and_a_faulty_network() {
    let url = std::env::var("IDEM_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    if let Err(e) = idem_runtime::PostgresStore::connect(&url).await {
        assert!(
            std::env::var_os("IDEM_REQUIRE_SERVICES").is_none(),
            "PostgreSQL at {url} is required (IDEM_REQUIRE_SERVICES): {e}"
        );
        eprintln!("skipped: PostgreSQL at {url} is unreachable ({e})");
        return;
    }
    let exe = std::env::current_exe().unwrap();
    let report = checkout::run(1000, &|| {
        let mut command = Command::new(&exe);
        command.args(["--ignored", "--exact", "checkout_service", "--nocapture"]);
        command
    })
    .await
    .expect("the chain ran");
    println!("{report}");
    assert!(
        report.kills >= 3,
        "the service was killed: {}",
        report.kills
    );
    assert!(
        report.attempts > report.checkouts,
        "the network lost attempts"
    );
    for (name, counts) in [
        ("reservations", &report.reservations),
        ("charges", &report.charges),
    ] {
        assert_eq!(
            counts.len() as u64,
            report.checkouts,
            "every checkout made {name}"
        );
        for (order, n) in counts {
            assert_eq!(*n, 1, "order {order}: {n} {name}");
        }
    }
    assert_eq!(
        report.orders.len() as u64,
        report.checkouts,
        "every checkout wrote its order"
    );
    for (order, n) in &report.orders {
        assert_eq!(*n, 1, "order {order}: {n} order rows");
    }
    assert_eq!(report.wrong_receipts, 0, "every client got its own receipt");
    assert_eq!(report.held, 0, "no claim is left held");
    assert!(report.exactly_once());
}
