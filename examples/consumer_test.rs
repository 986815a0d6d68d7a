//! The consumer example against real NATS JetStream and PostgreSQL: 200 orders, each
//! delivered at least twice, each applied exactly once.

#[path = "consumer.rs"]
mod consumer;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_order_is_delivered_at_least_twice_and_applied_once() {
    let nats = std::env::var("IDEM_NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into());
    if let Err(e) = async_nats::connect(&nats).await {
        assert!(
            std::env::var_os("IDEM_REQUIRE_SERVICES").is_none(),
            "NATS at {nats} is required (IDEM_REQUIRE_SERVICES): {e}"
        );
        eprintln!("skipped: NATS at {nats} is unreachable ({e})");
        return;
    }
    let report = consumer::run(200).await.expect("the consumer ran");
    assert_eq!(report.deliveries.len(), 200, "every order was delivered");
    for (order, deliveries) in &report.deliveries {
        assert!(
            *deliveries >= 2,
            "order {order}: delivered {deliveries} time(s)"
        );
        assert_eq!(
            report.shipments.get(order),
            Some(&1),
            "order {order}: exactly one shipment"
        );
    }
    assert_eq!(report.shipments.len(), 200, "no shipment without an order");
    assert_eq!(
        report.taken, report.ordered,
        "the stock moved by exactly the orders"
    );
}
