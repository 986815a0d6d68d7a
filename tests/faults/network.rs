//! Connections stalled and cut by a loopback proxy between a store and its server.

use super::*;

/// A loopback TCP proxy between a store and its server that can stall (hold every byte
/// until it passes again) or cut (close every open connection).
struct Proxy {
    port: u16,
    /// Whether bytes are held.
    stalled: watch::Sender<bool>,
    /// How many cuts so far: a connection opened before the last one is closed.
    cuts: Arc<AtomicUsize>,
}

impl Proxy {
    async fn start(upstream: u16) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let (stalled, _) = watch::channel(false);
        let cuts = Arc::new(AtomicUsize::new(0));
        let proxy = Self {
            port,
            stalled: stalled.clone(),
            cuts: cuts.clone(),
        };
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = TcpStream::connect(("127.0.0.1", upstream)).await else {
                    continue;
                };
                let born = cuts.load(Ordering::SeqCst);
                let (client_read, client_write) = client.into_split();
                let (server_read, server_write) = server.into_split();
                for (from, to) in [(client_read, server_write), (server_read, client_write)] {
                    let (cuts, stalled) = (cuts.clone(), stalled.subscribe());
                    tokio::spawn(pump(from, to, born, cuts, stalled));
                }
            }
        });
        proxy
    }

    fn stall(&self, stalled: bool) {
        self.stalled.send_replace(stalled);
    }

    fn cut(&self) {
        self.cuts.fetch_add(1, Ordering::SeqCst);
        // Wakes every pump, so that each sees the cut.
        self.stalled.send_modify(|_| {});
    }
}

/// Copies bytes one way: holds them while stalled, and stops (closing the connection) once
/// a cut happened after the connection was opened.
async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    born: usize,
    cuts: Arc<AtomicUsize>,
    mut stalled: watch::Receiver<bool>,
) {
    let cut = || cuts.load(Ordering::SeqCst) != born;
    let mut buf = vec![0_u8; 16 * 1024];
    loop {
        let n = tokio::select! {
            read = from.read(&mut buf) => match read {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            },
            changed = stalled.changed() => {
                if changed.is_err() || cut() {
                    return;
                }
                continue;
            }
        };
        while *stalled.borrow_and_update() && !cut() {
            if stalled.changed().await.is_err() {
                return;
            }
        }
        if cut() || to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

/// Through a proxy: a stalled connection makes calls fail with `Error::Store` within the
/// store's timeout, never hang and never run the body; after the stall, and after a cut in
/// the middle of a body, each key runs once and its retry replays it.
async fn stalled_and_cut<S: Store + Clone>(
    label: &str,
    store: S,
    timeout: Duration,
    proxy: &Proxy,
) {
    let op = Operation::new(namespace(&format!("proxy.{label}"))).lease(LEASE);
    let ledger = Ledger::default();
    let timed = |key: u32| {
        let (op, store, ledger) = (op.clone(), store.clone(), ledger.clone());
        let label = label.to_string();
        async move {
            let k = op.key(&key).unwrap();
            let call = op.run(&store, &k, None, async {
                Ok::<_, Error>(ledger.body(key, std::future::ready(())).await)
            });
            let started = std::time::Instant::now();
            let answered = tokio::time::timeout(timeout * 4 + Duration::from_secs(5), call)
                .await
                .unwrap_or_else(|_| panic!("{label}: a call hung past its timeout"));
            (answered, started.elapsed())
        }
    };
    let run = |key: u32| {
        let timed = timed(key);
        async move { timed.await.0 }
    };
    assert_eq!(run(1).await.unwrap(), Outcome::Executed(1));

    proxy.stall(true);
    let mut stalled = Vec::new();
    for key in 2..12 {
        stalled.push(tokio::spawn(timed(key)));
    }
    let mut failed = 0;
    let mut slowest = Duration::ZERO;
    for call in stalled {
        let (answered, took) = call.await.unwrap();
        let err = answered.unwrap_err();
        assert!(matches!(err, Error::Store(_)), "{label}: {err}");
        failed += 1;
        slowest = slowest.max(took);
    }
    // The claim is sent again after the first try fails, within the same deadline: a
    // stalled call fails after one timeout, not one per try (three tries took 3x). The
    // bound leaves a whole timeout of slack for a busy machine's late timers.
    assert!(
        slowest < timeout * 2,
        "{label}: a stalled call took {slowest:?}, its store's timeout is {timeout:?}"
    );
    assert_eq!(
        ledger.bodies(),
        1,
        "{label}: no body runs while the store is stalled"
    );
    proxy.stall(false);

    // The connections that stalled recover, or are replaced: each key runs once.
    let mut recovered = 0;
    for key in 2..12 {
        for _ in 0..20 {
            if run(key).await.is_ok() {
                recovered += 1;
                break;
            }
        }
    }

    // A cut while the body runs: the completion fails, is retried on a new connection, and
    // the result is recorded.
    let (in_body, entered) = tokio::sync::oneshot::channel();
    let (go_on, proceed) = tokio::sync::oneshot::channel::<()>();
    let holder = {
        let (op, store, ledger) = (op.clone(), store.clone(), ledger.clone());
        tokio::spawn(async move {
            let k = op.key(&100_u32).unwrap();
            op.run(&store, &k, None, async move {
                let _ = in_body.send(());
                let _ = proceed.await;
                Ok::<_, Error>(ledger.body(100, std::future::ready(())).await)
            })
            .await
        })
    };
    entered.await.unwrap();
    proxy.cut();
    go_on.send(()).unwrap();
    let holder = holder.await.unwrap().unwrap();
    assert_eq!(holder, Outcome::Executed(100));
    let retry = run(100).await.unwrap();
    println!(
        "{label} through a proxy: stalled: {failed} calls failed with Error::Store (the slowest after {slowest:?}, timeout {timeout:?}), none ran; \
         after the stall {recovered} of 10 keys ran; cut mid-body: the retry was {retry:?}; keys run twice: {}",
        ledger.doubles()
    );
    assert_eq!(
        retry,
        Outcome::Replayed(100),
        "{label}: recorded across the cut"
    );
    assert_eq!(recovered, 10);
    assert_eq!(ledger.doubles(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_through_a_stalling_and_cutting_proxy() {
    if redis_store().await.is_none() {
        return;
    }
    let upstream = url_port(&redis_url(), 6379);
    let proxy = Proxy::start(upstream).await;
    let timeout = Duration::from_secs(1);
    let store = RedisStore::connect(&format!("redis://127.0.0.1:{}", proxy.port))
        .await
        .unwrap()
        .with_timeout(timeout);
    stalled_and_cut("redis", store, timeout, &proxy).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_through_a_stalling_and_cutting_proxy() {
    if postgres_store().await.is_none() {
        return;
    }
    let url = postgres_url();
    let upstream = url_port(&url, 5432);
    let proxy = Proxy::start(upstream).await;
    let timeout = Duration::from_secs(1);
    let proxied = url.replacen(&format!(":{upstream}"), &format!(":{}", proxy.port), 1);
    let store = PostgresStore::connect(&proxied)
        .await
        .unwrap()
        .with_timeout(timeout);
    stalled_and_cut("postgres", store, timeout, &proxy).await;
}

/// The port of a `scheme://[user@]host:port/…` URL.
fn url_port(url: &str, default: u16) -> u16 {
    let authority = url.split("://").nth(1).unwrap_or(url);
    let host = authority.split('/').next().unwrap_or(authority);
    let host = host.rsplit('@').next().unwrap_or(host);
    host.rsplit_once(':')
        .and_then(|(_, port)| port.parse().ok())
        .unwrap_or(default)
}
