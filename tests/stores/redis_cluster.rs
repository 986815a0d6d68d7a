//! `RedisStore` on a real 3-master Redis Cluster, which each test starts on free loopback
//! ports (or the one `IDEM_REDIS_CLUSTER_URLS` names): the store contract holds, and keys
//! spread over the masters.

use std::sync::Arc;

use idem_runtime::testkit;
use idem_runtime::{Error, Operation, RedisStore};
use idem_tests::{unavailable, PrivateRedisCluster, Runs};

/// A cluster's masters, and the private cluster to keep alive while they are used.
fn nodes() -> Option<(Vec<String>, Option<PrivateRedisCluster>)> {
    match std::env::var("IDEM_REDIS_CLUSTER_URLS") {
        Ok(urls) => Some((urls.split(',').map(str::to_string).collect(), None)),
        Err(_) => {
            let cluster = PrivateRedisCluster::start()?;
            Some((cluster.urls(), Some(cluster)))
        }
    }
}

async fn cluster(nodes: &[String]) -> Option<RedisStore> {
    match RedisStore::connect_cluster(nodes.iter().map(String::as_str)).await {
        Ok(store) => Some(store),
        Err(e) => unavailable(&format!("the redis cluster at {nodes:?}"), e),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_cluster_store_keeps_the_store_contract() {
    let Some((nodes, _cluster)) = nodes() else {
        return;
    };
    let Some(store) = cluster(&nodes).await else {
        return;
    };
    testkit::conformance(&store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_spread_over_every_master_and_each_runs_once() {
    let Some((nodes, _cluster)) = nodes() else {
        return;
    };
    let Some(store) = cluster(&nodes).await else {
        return;
    };
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
                        tokio::task::yield_now().await;
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

    for node in &nodes {
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
