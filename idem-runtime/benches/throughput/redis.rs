//! The throughput rows of Redis, on a private server.

use super::*;

/// A `redis-server` of the bench's own, on a free port, gone when dropped.
struct PrivateRedis {
    child: Child,
    url: String,
}

impl PrivateRedis {
    fn start() -> Option<Self> {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .ok()?
            .local_addr()
            .ok()?
            .port();
        let child = Command::new("redis-server")
            .args(["--bind", "127.0.0.1", "--port", &port.to_string()])
            .args(["--save", "", "--appendonly", "no"])
            .stdout(Stdio::null())
            .spawn()
            .ok()?;
        Some(Self {
            child,
            url: format!("redis://127.0.0.1:{port}"),
        })
    }
}

impl Drop for PrivateRedis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The throughput rows of Redis; returns its server-cost rows.
pub(super) async fn redis() -> Vec<String> {
    let private = std::env::var("IDEM_REDIS_URL")
        .is_err()
        .then(PrivateRedis::start)
        .flatten();
    let url = match &private {
        Some(server) => server.url.clone(),
        None => std::env::var("IDEM_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into()),
    };
    let mut store = Err(Error::store("not tried"));
    // A server just started takes a moment to listen.
    for _ in 0..50 {
        store = RedisStore::connect(&url).await;
        if store.is_ok() {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    let Ok(store) = store else {
        println!("redis: skipped ({url} unreachable)");
        return Vec::new();
    };
    let raw = redis::aio::ConnectionManager::new(redis::Client::open(url.as_str()).unwrap())
        .await
        .unwrap();
    let op = Arc::new(Operation::new(format!(
        "throughput.redis.{:?}",
        Instant::now()
    )));
    let value = serde_json::to_vec(&receipt(1)).unwrap();
    let server = Server::Redis(raw.clone());

    let first = idempotent_calls(&op, &store, fresh);
    let base_first = {
        let (raw, value) = (raw.clone(), value.clone());
        move |n: u64| {
            let (mut raw, value) = (raw.clone(), value.clone());
            async move {
                let key = format!("throughput:{n}");
                let _: Option<String> = redis::cmd("SET")
                    .arg(&key)
                    .arg("p")
                    .arg("NX")
                    .arg("PX")
                    .arg(30_000)
                    .query_async(&mut raw)
                    .await
                    .unwrap();
                let _: () = redis::cmd("SET")
                    .arg(&key)
                    .arg(&value)
                    .arg("PX")
                    .arg(60_000)
                    .query_async(&mut raw)
                    .await
                    .unwrap();
            }
        }
    };
    first_executions(
        "redis, first executions, 64 callers",
        &server,
        Some(0.6),
        first.clone(),
        base_first.clone(),
    )
    .await;
    let replay = idempotent_calls(&op, &store, recorded);
    let base_replay = {
        let raw = raw.clone();
        move |n: u64| {
            let mut raw = raw.clone();
            async move {
                let _: Option<Vec<u8>> = redis::cmd("GET")
                    .arg(format!("throughput:{}", REPLAYED + n % RECORDED))
                    .query_async(&mut raw)
                    .await
                    .unwrap();
            }
        }
    };
    compare(
        "redis, replays, 64 callers",
        &server,
        Some(0.8),
        replay.clone(),
        base_replay.clone(),
    )
    .await;
    // The floors: the least a hand-written client keeping idem's guarantees on Redis 7.0
    // sends and computes (a SHA-256 key, a claim that returns what is there, a completion
    // only its holder can make, the value in JSON), against the same baselines.
    let floor_first = {
        let raw = raw.clone();
        move |n: u64| {
            let mut raw = raw.clone();
            async move {
                let key = redis_floor::key(n);
                if redis_floor::claim(&mut raw, &key, n).await.is_none() {
                    let value = serde_json::to_vec(&receipt(n)).unwrap();
                    assert!(redis_floor::complete(&mut raw, &key, n, &value).await);
                }
            }
        }
    };
    first_executions(
        "redis, first executions, floor (see the header)",
        &server,
        None,
        floor_first.clone(),
        base_first.clone(),
    )
    .await;
    let floor_replay = {
        let raw = raw.clone();
        move |n: u64| {
            let mut raw = raw.clone();
            async move {
                let n = REPLAYED + n % RECORDED;
                let record = redis_floor::claim(&mut raw, &redis_floor::key(n), n)
                    .await
                    .expect("recorded");
                let _: common::Receipt = serde_json::from_slice(&record[1..]).unwrap();
            }
        }
    };
    compare(
        "redis, replays, floor (see the header)",
        &server,
        None,
        floor_replay.clone(),
        base_replay.clone(),
    )
    .await;
    compare(
        "redis, first executions vs the floor",
        &server,
        None,
        first.clone(),
        floor_first.clone(),
    )
    .await;
    compare(
        "redis, replays vs the floor",
        &server,
        None,
        replay.clone(),
        floor_replay,
    )
    .await;
    vec![
        server_cost(
            "redis, first execution vs SET NX PX + SET PX",
            &server,
            1.5,
            first,
            base_first,
        )
        .await,
        server_cost("redis, replay vs GET", &server, 1.2, replay, base_replay).await,
    ]
}
