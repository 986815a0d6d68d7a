//! The checkout service: its own process, started and killed by the driver.

use super::*;

/// What the checkout service runs with, passed to its process in the environment.
struct Service {
    shop: String,
    gateway: String,
    downstream: Keyed,
    store: PostgresStore,
    orders: String,
}

impl Service {
    /// One downstream call of the running step. The client's `IdempotencyKeyLayer` keys it
    /// with the step's own key (`attempt().key()`): the same on every attempt of the
    /// checkout, so that the service called dedupes it.
    async fn call(&self, url: &str, order: &Order) -> Result<String, Error> {
        let body = serde_json::to_vec(order).map_err(Error::codec)?;
        let (status, body, _) = send(&self.downstream, url, None, body)
            .await
            .map_err(Error::store)?;
        if status != StatusCode::CREATED {
            return Err(Error::store(format!("{url} answered {status}")));
        }
        let made: Made = serde_json::from_slice(&body).map_err(Error::codec)?;
        Ok(made.id)
    }

    /// The order row, claimed and written in one transaction under the step's key: a retry
    /// of the step after a kill that came between the commit and the step's record finds
    /// the committed claim and replays the row's id.
    async fn write_order(&self, order: &Order, hold: &str, charge: &str) -> Result<i64, Error> {
        let step = attempt()
            .expect("a step runs under an attempt")
            .key()
            .to_hex();
        let op = Operation::new("examples.checkout.order.v1").lease(LEASE);
        let key = op.key(&step)?;
        let insert = format!(
            "INSERT INTO {} (order_id, hold, charge) VALUES ($1, $2, $3) RETURNING id",
            self.orders
        );
        let mut tx = self.store.pool().begin().await.map_err(Error::store)?;
        let row = op
            .run_in_transaction(
                &self.store,
                &mut tx,
                &key,
                None,
                async |tx: &mut PgConnection| {
                    let (row,): (i64,) = sqlx::query_as(&insert)
                        .bind(order.id as i64)
                        .bind(hold)
                        .bind(charge)
                        .fetch_one(&mut *tx)
                        .await
                        .map_err(Error::store)?;
                    Ok::<_, Error>(row)
                },
            )
            .await?
            .into_inner();
        tx.commit().await.map_err(Error::store)?;
        Ok(row)
    }

    async fn checkout(&self, order: &Order) -> Result<Receipt, Error> {
        let hold = step("reserve", self.call(&self.shop, order)).await?;
        let charge = step("charge", self.call(&self.gateway, order)).await?;
        let row = step("order", self.write_order(order, &hold, &charge)).await?;
        Ok(Receipt {
            order: order.id,
            hold,
            charge,
            row,
        })
    }
}

/// `POST /checkout`: a `201` with the receipt, or a `503` (not recorded: the client retries)
/// that says nothing of the cause.
async fn checkout(State(service): State<Arc<Service>>, Json(order): Json<Order>) -> Response {
    match service.checkout(&order).await {
        Ok(receipt) => (StatusCode::CREATED, Json(receipt)).into_response(),
        Err(error) => {
            eprintln!("checkout {}: {error}", order.id);
            (StatusCode::SERVICE_UNAVAILABLE, "try again").into_response()
        }
    }
}

fn env(name: &str) -> Result<String, BoxError> {
    std::env::var(name).map_err(|_| format!("{name} is not set").into())
}

/// The checkout service, configured by its environment: what the driver starts (and kills)
/// as a process of its own. Prints `listening` once it accepts connections.
pub async fn serve_from_env() -> Result<(), BoxError> {
    let store = PostgresStore::connect(&env("IDEM_POSTGRES_URL")?)
        .await?
        .with_table(&env("IDEM_CHECKOUT_TABLE")?)?;
    let service = Arc::new(Service {
        shop: env("IDEM_CHECKOUT_SHOP")?,
        gateway: env("IDEM_CHECKOUT_GATEWAY")?,
        downstream: keyed_client(Duration::from_secs(10)),
        store: store.clone(),
        orders: env("IDEM_CHECKOUT_ORDERS")?,
    });
    let app = Router::new()
        .route("/checkout", post(checkout))
        .with_state(service)
        .layer(
            IdempotencyLayer::new(store)
                .namespace("examples.checkout.v1")
                .unscoped()
                .required()
                .lease(LEASE),
        );
    let listener = TcpListener::bind(("127.0.0.1", env("IDEM_CHECKOUT_PORT")?.parse()?)).await?;
    println!("listening");
    axum::serve(listener, app).await?;
    Ok(())
}
