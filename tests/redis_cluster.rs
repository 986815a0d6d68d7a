//! `RedisStore` on a real 3-master Redis Cluster (started by `scripts/redis-cluster.sh`, which
//! `.ci/run` runs): the store contract holds, and keys spread over the masters.

use std::sync::Arc;
use std::time::Duration;

use idem_runtime::{testkit, Error, Operation, RedisStore};
use idem_tests::{unavailable, Runs};

fn nodes() -> Vec<String> {
    std::env::var("IDEM_REDIS_CLUSTER_URLS")
        .unwrap_or_else(|_| {
            "redis://127.0.0.1:7301,redis://127.0.0.1:7302,redis://127.0.0.1:7303".into()
        })
        .split(',')
        .map(str::to_string)
        .collect()
}

async fn cluster() -> Option<RedisStore> {
    let nodes = nodes();
    match RedisStore::connect_cluster(nodes.iter().map(String::as_str)).await {
        Ok(store) => Some(store),
        Err(e) => unavailable(
            &format!("the redis cluster at {nodes:?} (scripts/redis-cluster.sh start)"),
            e,
        ),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_cluster_store_keeps_the_store_contract() {
    let Some(store) = cluster().await else { return };
    testkit::conformance(&store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_spread_over_every_master_and_each_runs_once() {
    let Some(store) = cluster().await else { return };
    let op = Arc::new(Operation::new(format!(
        "cluster.spread.{:?}",
        std::time::SystemTime::now()
    )));
    let runs = Runs::default();
    let mut calls = Vec::new();
    for i in 0..60_u32 {
        for _ in 0..5 {
            let (op, store, runs) = (op.clone(), store.clone(), runs.clone());
            calls.push((
                i,
                tokio::spawn(async move {
                    let key = op.key(&i).unwrap();
                    op.run(&store, &key, None, async move {
                        runs.hit();
                        tokio::time::sleep(Duration::from_millis(10)).await;
                        Ok::<_, Error>(i)
                    })
                    .await
                }),
            ));
        }
    }
    for (i, call) in calls {
        assert_eq!(call.await.unwrap().unwrap().into_inner(), i);
    }
    assert_eq!(runs.count(), 60, "one run per key");

    for node in nodes() {
        let mut connection = redis::Client::open(node.as_str())
            .unwrap()
            .get_multiplexed_async_connection()
            .await
            .unwrap();
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg("idem:{*")
            .query_async(&mut connection)
            .await
            .unwrap();
        assert!(
            !keys.is_empty(),
            "master {node} holds no records: keys do not spread"
        );
    }
}
