use idem_runtime::http::IdempotencyLayer;
use idem_runtime::MemoryStore;

/// What `axum::Router::layer` and `tower::ServiceBuilder` require of a layer.
fn route<L: tower::Layer<Handler>>(_: L) {}

type Handler = tower::util::ServiceFn<fn(http::Request<()>) -> std::future::Ready<Result<http::Response<()>, std::convert::Infallible>>>;

fn main() {
    // The key scope was never chosen: `.scope(..)` or `.unscoped()` is missing.
    route(IdempotencyLayer::new(MemoryStore::new()).required());
}
