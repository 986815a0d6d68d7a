//! The shop and the gateway: in the driver, so that their counts survive the kills.

use super::*;

/// How many times each order was reserved and charged, and how often each was asked.
#[derive(Default)]
pub(super) struct Downstream {
    pub(super) reservations: Mutex<HashMap<u64, u32>>,
    pub(super) charges: Mutex<HashMap<u64, u32>>,
    /// The gateway's own memory of keys, as a payment gateway keeps it: key → charge.
    charged: Mutex<HashMap<String, String>>,
    pub(super) asked: AtomicU64,
}

/// `POST /reserve`, behind `IdempotencyLayer`: reserves the order's items.
pub(super) async fn reserve(
    State(down): State<Arc<Downstream>>,
    Json(order): Json<Order>,
) -> Response {
    down.asked.fetch_add(1, Ordering::Relaxed);
    let mut reservations = down.reservations.lock().unwrap();
    let n = reservations.entry(order.id).or_default();
    *n += 1;
    let id = format!("hold_{}_{n}", order.id);
    (StatusCode::CREATED, Json(Made { id })).into_response()
}

/// `POST /charge`: a gateway that charges once per `Idempotency-Key`, as real ones do, and
/// counts the charges it makes.
pub(super) async fn charge(
    State(down): State<Arc<Downstream>>,
    headers: HeaderMap,
    Json(order): Json<Order>,
) -> Response {
    down.asked.fetch_add(1, Ordering::Relaxed);
    let Some(key) = headers.get("idempotency-key").and_then(|k| k.to_str().ok()) else {
        return (StatusCode::BAD_REQUEST, "an Idempotency-Key is required").into_response();
    };
    let mut charged = down.charged.lock().unwrap();
    let id = charged
        .entry(key.to_string())
        .or_insert_with(|| {
            let mut charges = down.charges.lock().unwrap();
            let n = charges.entry(order.id).or_default();
            *n += 1;
            format!("ch_{}_{n}", order.id)
        })
        .clone();
    (StatusCode::CREATED, Json(Made { id })).into_response()
}

pub(super) async fn serve(app: Router) -> Result<SocketAddr, BoxError> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let address = listener.local_addr()?;
    tokio::spawn(async move { axum::serve(listener, app).await });
    Ok(address)
}
