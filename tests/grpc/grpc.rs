//! `idem_runtime::grpc` over real HTTP/2 connections, with tonic's own server and client:
//! a retried call replays its recorded message and metadata; each of idem's answers is the
//! status the docs give it; a cancelled call's response is recorded; and 1 000 charges
//! through a proxy that loses every third connection's answers, retried by
//! `grpc::send`, each run once.

mod payments;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem_runtime::grpc::{
    self, Idempotency, Scoped, ERROR_DOMAIN, IDEMPOTENCY_KEY, IDEMPOTENT_REPLAYED,
};
use idem_runtime::http::client::Retry;
use idem_runtime::{InFlight, MemoryStore};
use payments::{Charge, Payments, PaymentsClient, PaymentsServer, Receipt};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, Semaphore};
use tonic::transport::{Channel, Endpoint};
use tonic::{Code, Request, Response, Status};
use tonic_types::StatusExt as _;

/// The service under test: counts each order's runs, and, for order [`BLOCKS`], waits
/// until the test releases it.
struct Shop {
    idem: Idempotency<MemoryStore, Scoped>,
    runs: Arc<Mutex<HashMap<u64, u32>>>,
    started: Arc<Notify>,
    release: Arc<Notify>,
}

/// The order whose charge waits for [`Shop::release`].
const BLOCKS: u64 = 999_999;
/// The order whose charge fails.
const DECLINED: u64 = 666;

impl Shop {
    fn new(in_flight: InFlight) -> Self {
        let idem = Idempotency::new(MemoryStore::new())
            .in_flight(in_flight)
            .scope(|call| {
                let principal = call.metadata().get("x-principal")?;
                Some(principal.to_str().ok()?.to_owned())
            });
        Self {
            idem,
            runs: Arc::default(),
            started: Arc::default(),
            release: Arc::default(),
        }
    }

    fn runs(&self, order: u64) -> u32 {
        self.runs.lock().unwrap().get(&order).copied().unwrap_or(0)
    }
}

impl Payments for Shop {
    async fn charge(&self, request: Request<Charge>) -> Result<Response<Receipt>, Status> {
        let (runs, started, release) = (
            self.runs.clone(),
            self.started.clone(),
            self.release.clone(),
        );
        let by_fields = request.metadata().contains_key("x-key-by-fields");
        let body = move |request: Request<Charge>| async move {
            let charge = request.into_inner();
            if charge.order == BLOCKS {
                started.notify_one();
                release.notified().await;
            }
            if charge.order == DECLINED {
                return Err(Status::failed_precondition("card declined"));
            }
            let run = {
                let mut runs = runs.lock().unwrap();
                let run = runs.entry(charge.order).or_default();
                *run += 1;
                *run
            };
            let mut response = Response::new(Receipt {
                order: charge.order,
                cents: charge.cents,
                run,
            });
            response
                .metadata_mut()
                .insert("x-receipt", format!("r-{}", charge.order).parse().unwrap());
            response.metadata_mut().insert_bin(
                "x-trace-bin",
                tonic::metadata::MetadataValue::from_bytes(&[0, 159, 255]),
            );
            Ok(response)
        };
        if by_fields {
            self.idem
                .unary_by("test.charge.v1", request, |charge| charge.order, body)
                .await
        } else {
            self.idem.unary("test.charge.v1", request, body).await
        }
    }
}

async fn serve(shop: Arc<Shop>) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let server = tonic::transport::Server::builder()
        .add_service(PaymentsServer(shop))
        .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener));
    tokio::spawn(server);
    address
}

async fn client(address: SocketAddr) -> PaymentsClient {
    let channel = Endpoint::from_shared(format!("http://{address}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    PaymentsClient::new(channel)
}

fn charge(order: u64, cents: u64, key: Option<&str>, principal: Option<&str>) -> Request<Charge> {
    let mut request = Request::new(Charge { order, cents });
    if let Some(key) = key {
        request
            .metadata_mut()
            .insert(IDEMPOTENCY_KEY, key.parse().unwrap());
    }
    if let Some(principal) = principal {
        request
            .metadata_mut()
            .insert("x-principal", principal.parse().unwrap());
    }
    request
}

/// The reason of a status of idem's own, checking its domain.
fn reason(status: &Status) -> String {
    let info = status
        .get_details_error_info()
        .unwrap_or_else(|| panic!("no ErrorInfo in {status:?}"));
    assert_eq!(info.domain, ERROR_DOMAIN);
    info.reason
}

fn replayed<T>(response: &Response<T>) -> bool {
    response
        .metadata()
        .get(IDEMPOTENT_REPLAYED)
        .is_some_and(|value| value == "true")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_replays_the_recorded_message_and_metadata() {
    let shop = Arc::new(Shop::new(InFlight::Reject));
    let mut client = client(serve(shop.clone()).await).await;

    let first = client
        .charge(charge(1, 500, Some("k-1"), Some("alice")))
        .await
        .unwrap();
    assert!(!replayed(&first));
    let again = client
        .charge(charge(1, 500, Some("k-1"), Some("alice")))
        .await
        .unwrap();
    assert!(replayed(&again), "{:?}", again.metadata());
    assert_eq!(again.get_ref(), first.get_ref());
    assert_eq!(again.get_ref().run, 1);
    assert_eq!(again.metadata().get("x-receipt").unwrap(), "r-1");
    assert_eq!(
        again
            .metadata()
            .get_bin("x-trace-bin")
            .unwrap()
            .to_bytes()
            .unwrap()
            .as_ref(),
        [0, 159, 255]
    );
    assert_eq!(shop.runs(1), 1);

    // Another principal's equal key is another call.
    let bob = client
        .charge(charge(1, 500, Some("k-1"), Some("bob")))
        .await
        .unwrap();
    assert!(!replayed(&bob));
    assert_eq!(shop.runs(1), 2);

    // Keyed on fields: two keys, one order, one run.
    for key in ["f-1", "f-2"] {
        let mut request = charge(2, 700, Some(key), Some("alice"));
        request
            .metadata_mut()
            .insert("x-key-by-fields", "1".parse().unwrap());
        client.charge(request).await.unwrap();
    }
    assert_eq!(shop.runs(2), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_answer_of_idems_own_is_its_documented_status() {
    let shop = Arc::new(Shop::new(InFlight::Reject));
    let address = serve(shop.clone()).await;
    let mut client = client(address).await;

    // The same key with another message.
    client
        .charge(charge(3, 100, Some("k-3"), Some("alice")))
        .await
        .unwrap();
    let reused = client
        .charge(charge(3, 999, Some("k-3"), Some("alice")))
        .await
        .unwrap_err();
    assert_eq!(
        (reused.code(), reason(&reused).as_str()),
        (Code::FailedPrecondition, "KEY_REUSED")
    );
    assert_eq!(shop.runs(3), 1);

    // A keyed call whose principal cannot be named.
    let anonymous = client
        .charge(charge(4, 100, Some("k-4"), None))
        .await
        .unwrap_err();
    assert_eq!(
        (anonymous.code(), reason(&anonymous).as_str()),
        (Code::Unauthenticated, "PRINCIPAL_UNKNOWN")
    );
    assert_eq!(shop.runs(4), 0);

    // A malformed key.
    let malformed = client
        .charge(charge(5, 100, Some("\"open"), Some("alice")))
        .await
        .unwrap_err();
    assert_eq!(
        (malformed.code(), reason(&malformed).as_str()),
        (Code::InvalidArgument, "KEY_MALFORMED")
    );

    // The body's own status releases the key: a retry runs again.
    for _ in 0..2 {
        let declined = client
            .charge(charge(DECLINED, 100, Some("k-6"), Some("alice")))
            .await
            .unwrap_err();
        assert_eq!(
            (declined.code(), declined.message()),
            (Code::FailedPrecondition, "card declined")
        );
        assert!(
            declined.get_details_error_info().is_none(),
            "the body's status is its own"
        );
    }

    // A retry while the first call runs.
    let mut first = client.clone();
    let running = tokio::spawn(async move {
        first
            .charge(charge(BLOCKS, 100, Some("k-7"), Some("alice")))
            .await
    });
    shop.started.notified().await;
    let in_flight = client
        .charge(charge(BLOCKS, 100, Some("k-7"), Some("alice")))
        .await
        .unwrap_err();
    assert_eq!(
        (in_flight.code(), reason(&in_flight).as_str()),
        (Code::Aborted, "IN_FLIGHT")
    );
    assert!(in_flight
        .get_details_retry_info()
        .and_then(|info| info.retry_delay)
        .is_some());
    shop.release.notify_one();
    assert!(!replayed(&running.await.unwrap().unwrap()));

    // Without a key the body runs, unprotected, unless keys are required.
    client.charge(charge(8, 100, None, None)).await.unwrap();
    client.charge(charge(8, 100, None, None)).await.unwrap();
    assert_eq!(shop.runs(8), 2);
    let strict = Idempotency::new(MemoryStore::new()).unscoped().required();
    let missing = strict
        .unary("test.strict.v1", charge(9, 1, None, None), |_| async {
            Ok(Response::new(Receipt::default()))
        })
        .await
        .unwrap_err();
    assert_eq!(
        (missing.code(), reason(&missing).as_str()),
        (Code::InvalidArgument, "KEY_MISSING")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_call_is_recorded_and_its_retry_replays() {
    let shop = Arc::new(Shop::new(InFlight::Wait));
    let address = serve(shop.clone()).await;
    let mut client = client(address).await;

    let mut first = client.clone();
    let cancelled = tokio::spawn(async move {
        first
            .charge(charge(BLOCKS, 250, Some("k-c"), Some("alice")))
            .await
    });
    shop.started.notified().await;
    // The client gives up: its call is cancelled (an RST_STREAM reaches the server).
    cancelled.abort();
    assert!(cancelled.await.unwrap_err().is_cancelled());
    shop.release.notify_one();
    // The retry waits for the body, which went on, and replays its response.
    let retried = client
        .charge(charge(BLOCKS, 250, Some("k-c"), Some("alice")))
        .await
        .unwrap();
    assert!(replayed(&retried));
    assert_eq!(retried.get_ref().run, 1);
    assert_eq!(shop.runs(BLOCKS), 1);
}

// ---- a lossy network -------------------------------------------------------------------

/// Charges in all, and at once.
const CHARGES: u64 = 1000;
const CONCURRENT: usize = 16;

/// A TCP proxy to `upstream` whose every third connection loses the server's answers: once
/// the client has sent a request, whatever the server sends next is dropped, with the
/// connection. Counts the connections.
async fn lossy_proxy(upstream: SocketAddr, connections: Arc<AtomicU64>) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let (client, _) = listener.accept().await.unwrap();
            let n = connections.fetch_add(1, Ordering::SeqCst);
            tokio::spawn(relay(client, upstream, n % 3 == 2));
        }
    });
    address
}

/// The bytes of an HTTP/2 client's preface and first SETTINGS, about: past them, a client
/// has sent a request.
const PREFACE: u64 = 100;

async fn relay(client: TcpStream, upstream: SocketAddr, lossy: bool) {
    let Ok(server) = TcpStream::connect(upstream).await else {
        return;
    };
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = server.into_split();
    let sent = Arc::new(AtomicU64::new(0));
    let upward = {
        let sent = sent.clone();
        tokio::spawn(async move {
            let mut buffer = vec![0; 16 * 1024];
            loop {
                let read = match client_read.read(&mut buffer).await {
                    Ok(0) | Err(_) => break,
                    Ok(read) => read,
                };
                if server_write.write_all(&buffer[..read]).await.is_err() {
                    break;
                }
                sent.fetch_add(read as u64, Ordering::SeqCst);
            }
        })
    };
    let mut buffer = vec![0; 16 * 1024];
    loop {
        let read = match server_read.read(&mut buffer).await {
            Ok(0) | Err(_) => break,
            Ok(read) => read,
        };
        if lossy && sent.load(Ordering::SeqCst) > PREFACE {
            break;
        }
        if client_write.write_all(&buffer[..read]).await.is_err() {
            break;
        }
    }
    upward.abort();
}

/// One attempt of a charge, on a connection of its own through `endpoint`: a connection
/// that fails is a status with a source, which `grpc::send` retries.
async fn charge_on_a_new_connection(
    endpoint: Endpoint,
    request: Request<Charge>,
) -> Result<Response<Receipt>, Status> {
    let channel: Channel = endpoint
        .connect()
        .await
        .map_err(|err| Status::from_error(Box::new(err)))?;
    PaymentsClient::new(channel).charge(request).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_charges_through_a_lossy_proxy_each_run_once() {
    let shop = Arc::new(Shop::new(InFlight::Reject));
    let server = serve(shop.clone()).await;
    let connections = Arc::new(AtomicU64::new(0));
    let proxy = lossy_proxy(server, connections.clone()).await;
    let endpoint = Endpoint::from_shared(format!("http://{proxy}")).unwrap();
    let retry = Retry::new()
        .attempts(50)
        .budget(Duration::from_secs(120))
        .backoff(Duration::from_millis(1), Duration::from_millis(20));
    let replays = Arc::new(AtomicU64::new(0));
    let permits = Arc::new(Semaphore::new(CONCURRENT));
    let mut calls = tokio::task::JoinSet::new();
    // Orders from 10 000: none is [`DECLINED`] or [`BLOCKS`].
    let orders = 10_000..10_000 + CHARGES;
    for order in orders.clone() {
        let permit = permits.clone().acquire_owned().await.unwrap();
        let (endpoint, retry, replays) = (endpoint.clone(), retry.clone(), replays.clone());
        calls.spawn(async move {
            let _permit = permit;
            // One key for the logical charge, however many connections its attempts take:
            // each attempt on a connection of its own.
            let request = charge(order, 100 + order, None, Some("alice"));
            let answer = grpc::send(&retry, request, |request| {
                charge_on_a_new_connection(endpoint.clone(), request)
            })
            .await;
            let response = answer.unwrap_or_else(|status| panic!("order {order}: {status:?}"));
            assert_eq!(response.get_ref().order, order);
            assert_eq!(response.get_ref().run, 1, "order {order} ran again");
            if replayed(&response) {
                replays.fetch_add(1, Ordering::Relaxed);
            }
        });
    }
    while let Some(call) = calls.join_next().await {
        call.unwrap();
    }
    for order in orders {
        assert_eq!(shop.runs(order), 1, "order {order}");
    }
    let connections = connections.load(Ordering::SeqCst);
    let replays = replays.load(Ordering::Relaxed);
    eprintln!("{CHARGES} charges over {connections} connections, {replays} answered by a replay");
    assert!(
        connections > CHARGES,
        "answers were lost, so calls were retried"
    );
    assert!(replays > 0, "an answer lost after its charge was replayed");

    // A key reused with another message, through the same network: its documented status.
    let mut request = charge(0, 1, None, Some("alice"));
    request
        .metadata_mut()
        .insert(IDEMPOTENCY_KEY, "reused".parse().unwrap());
    let send = |request| charge_on_a_new_connection(endpoint.clone(), request);
    grpc::send(&retry, request, send).await.unwrap();
    let mut request = charge(0, 2, None, Some("alice"));
    request
        .metadata_mut()
        .insert(IDEMPOTENCY_KEY, "reused".parse().unwrap());
    let reused = grpc::send(&retry, request, send).await.unwrap_err();
    assert_eq!(
        (reused.code(), reason(&reused).as_str()),
        (Code::FailedPrecondition, "KEY_REUSED")
    );
}
