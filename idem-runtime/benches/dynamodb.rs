//! `DynamoDbStore` on the emulator (dynoxide at `IDEM_DYNAMODB_URL`, default
//! `http://127.0.0.1:8000`), each path interleaved with the hand-written request a service
//! without idem would send (`interleaved/mod.rs`): a first execution against one `PutItem`
//! of the result, a replay against one `GetItem`. Beside them, the floor of a first
//! execution: the least a client keeping idem's guarantees sends, a conditional claim and a
//! conditional completion (two `UpdateItem`s). Target: the floor + 10 %; a replay, one
//! round trip, ≤ 1.3 of a `GetItem`.
//!
//! `cargo bench -p idem-runtime --bench dynamodb --features dynamodb`

#[allow(dead_code)] // the Redis helpers are other benches'
mod common;
mod interleaved;

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use aws_sdk_dynamodb::config::{BehaviorVersion, Credentials, Region};
use aws_sdk_dynamodb::types::AttributeValue;
use idem_runtime::{DynamoDbStore, Error, Operation};
use interleaved::{measure, on as side, Ratio};

const BUDGET: Duration = Duration::from_secs(4);
const TABLE: &str = "idem_bench";
/// The hand-written sides' table, with the same key schema.
const RAW_TABLE: &str = "idem_bench_raw";

fn fresh() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    common::run_start() * 1_000_000 + NEXT.fetch_add(1, Ordering::Relaxed)
}

fn client(url: &str) -> aws_sdk_dynamodb::Client {
    let config = aws_sdk_dynamodb::Config::builder()
        .behavior_version(BehaviorVersion::latest())
        .region(Region::new("us-east-1"))
        .endpoint_url(url)
        .credentials_provider(Credentials::new("bench", "bench", None, None, "bench"))
        .http_client(aws_smithy_http_client::Builder::new().build_http())
        .build();
    aws_sdk_dynamodb::Client::from_conf(config)
}

fn print(path: &str, r: Ratio, floor: Option<Ratio>, target: f64) {
    let floor_text = floor.map_or("-".into(), |f| format!("{:.2}", f.median));
    let verdict = if r.median <= target { "ok" } else { "MISSED" };
    println!(
        "{path:<40} {:>10.1?} {:>10.1?} {:>6.2} {:>13} {floor_text:>6} {target:>7.2} {:>6} {verdict}",
        r.ours,
        r.baseline,
        r.median,
        format!("{:.2} – {:.2}", r.low, r.high),
        r.pairs,
    );
}

fn main() {
    let rt = common::runtime();
    let url = std::env::var("IDEM_DYNAMODB_URL").unwrap_or_else(|_| "http://127.0.0.1:8000".into());
    let client = client(&url);
    let store = DynamoDbStore::new(client.clone(), TABLE);
    let raw = DynamoDbStore::new(client.clone(), RAW_TABLE);
    if let Err(err) = rt.block_on(async {
        store.migrate().await?;
        raw.migrate().await
    }) {
        println!("skipped: no DynamoDB endpoint at {url}: {err}");
        return;
    }
    let op = Operation::new("bench.dynamodb");
    let json = serde_json::to_vec(&common::receipt(1)).unwrap();
    let recorded = op.key(&"recorded").unwrap();
    let _ = rt
        .block_on(op.run(&store, &recorded, None, async {
            Ok::<_, Error>(common::receipt(1))
        }))
        .unwrap();

    let put = || async {
        client
            .put_item()
            .table_name(RAW_TABLE)
            .item("id", AttributeValue::S(op.key(&fresh()).unwrap().to_hex()))
            .item("value", AttributeValue::B(json.clone().into()))
            .send()
            .await
            .unwrap()
    };
    let first = measure(
        &mut side(&rt, || async {
            let key = op.key(&fresh()).unwrap();
            op.run(&store, &key, None, async {
                Ok::<_, Error>(common::receipt(1))
            })
            .await
            .unwrap()
        }),
        &mut side(&rt, put),
        BUDGET,
    );
    // The floor: a conditional claim, then a conditional completion of it.
    let floor = measure(
        &mut side(&rt, || async {
            let id = AttributeValue::S(op.key(&fresh()).unwrap().to_hex());
            client
                .update_item()
                .table_name(RAW_TABLE)
                .key("id", id.clone())
                .update_expression("SET #s = :p, #t = if_not_exists(#t, :zero) + :one")
                .condition_expression("attribute_not_exists(id)")
                .expression_attribute_names("#s", "state")
                .expression_attribute_names("#t", "token")
                .expression_attribute_values(":p", AttributeValue::S("IN_PROGRESS".into()))
                .expression_attribute_values(":zero", AttributeValue::N("0".into()))
                .expression_attribute_values(":one", AttributeValue::N("1".into()))
                .send()
                .await
                .unwrap();
            client
                .update_item()
                .table_name(RAW_TABLE)
                .key("id", id)
                .update_expression("SET #s = :c, #v = :v")
                .condition_expression("#s = :p AND #t = :one")
                .expression_attribute_names("#s", "state")
                .expression_attribute_names("#t", "token")
                .expression_attribute_names("#v", "value")
                .expression_attribute_values(":p", AttributeValue::S("IN_PROGRESS".into()))
                .expression_attribute_values(":c", AttributeValue::S("COMPLETED".into()))
                .expression_attribute_values(":one", AttributeValue::N("1".into()))
                .expression_attribute_values(":v", AttributeValue::B(json.clone().into()))
                .send()
                .await
                .unwrap()
        }),
        &mut side(&rt, put),
        BUDGET,
    );
    let get = || async {
        client
            .get_item()
            .table_name(TABLE)
            .key("id", AttributeValue::S(recorded.to_hex()))
            .consistent_read(true)
            .send()
            .await
            .unwrap()
    };
    let replay = measure(
        &mut side(&rt, || async {
            op.run(&store, &recorded, None, async {
                Ok::<_, Error>(common::receipt(2))
            })
            .await
            .unwrap()
        }),
        &mut side(&rt, get),
        BUDGET,
    );
    println!(
        "\n{:<40} {:>10} {:>10} {:>6} {:>13} {:>6} {:>7} {:>6}",
        "path", "ours", "baseline", "ratio", "p10 – p90", "floor", "target", "pairs"
    );
    print(
        "DynamoDB first execution vs PutItem",
        first,
        Some(floor),
        floor.median * 1.1,
    );
    print(
        "  floor: claim + completion (2 UpdateItem)",
        floor,
        None,
        f64::INFINITY,
    );
    print("DynamoDB replay vs GetItem", replay, None, 1.3);
}
