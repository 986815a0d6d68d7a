//! A `Payments` gRPC service with one unary method, `Charge`, written out as tonic-build
//! would generate it from this proto, so that the tests need no `protoc`:
//!
//! ```proto
//! package idem.test;
//! message Charge { uint64 order = 1; uint64 cents = 2; }
//! message Receipt { uint64 order = 1; uint64 cents = 2; uint32 run = 3; }
//! service Payments { rpc Charge(Charge) returns (Receipt); }
//! ```

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use tonic::body::Body;
use tonic::codegen::http;
use tonic::server::NamedService;
use tonic::{Request, Response, Status};
use tonic_prost::ProstCodec;

#[derive(Clone, PartialEq, prost::Message)]
pub struct Charge {
    #[prost(uint64, tag = "1")]
    pub order: u64,
    #[prost(uint64, tag = "2")]
    pub cents: u64,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Receipt {
    #[prost(uint64, tag = "1")]
    pub order: u64,
    #[prost(uint64, tag = "2")]
    pub cents: u64,
    /// Which run of the order's charge produced it (1 for the first).
    #[prost(uint32, tag = "3")]
    pub run: u32,
}

const CHARGE: &str = "/idem.test.Payments/Charge";

/// The service's methods, as the generated trait has them.
pub trait Payments: Send + Sync + 'static {
    fn charge(
        &self,
        request: Request<Charge>,
    ) -> impl Future<Output = Result<Response<Receipt>, Status>> + Send;
}

/// The server side: routes `Charge` to a [`Payments`].
pub struct PaymentsServer<T>(pub Arc<T>);

impl<T> Clone for PaymentsServer<T> {
    fn clone(&self) -> Self {
        Self(Arc::clone(&self.0))
    }
}

impl<T> NamedService for PaymentsServer<T> {
    const NAME: &'static str = "idem.test.Payments";
}

struct ChargeSvc<T>(Arc<T>);

impl<T: Payments> tonic::server::UnaryService<Charge> for ChargeSvc<T> {
    type Response = Receipt;
    type Future = Pin<Box<dyn Future<Output = Result<Response<Receipt>, Status>> + Send>>;

    fn call(&mut self, request: Request<Charge>) -> Self::Future {
        let inner = Arc::clone(&self.0);
        Box::pin(async move { inner.charge(request).await })
    }
}

impl<T, B> tower::Service<http::Request<B>> for PaymentsServer<T>
where
    T: Payments,
    B: http_body::Body + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>> + Send + 'static,
{
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let inner = Arc::clone(&self.0);
        Box::pin(async move {
            if request.uri().path() != CHARGE {
                return Ok(Status::unimplemented("no such method").into_http());
            }
            let mut grpc = tonic::server::Grpc::new(ProstCodec::default());
            Ok(grpc.unary(ChargeSvc(inner), request).await)
        })
    }
}

/// The client side, over any tonic channel.
#[derive(Clone)]
pub struct PaymentsClient(tonic::client::Grpc<tonic::transport::Channel>);

impl PaymentsClient {
    pub fn new(channel: tonic::transport::Channel) -> Self {
        Self(tonic::client::Grpc::new(channel))
    }

    pub async fn charge(&mut self, request: Request<Charge>) -> Result<Response<Receipt>, Status> {
        self.0
            .ready()
            .await
            .map_err(|err| Status::unavailable(format!("not ready: {err}")))?;
        let path = http::uri::PathAndQuery::from_static(CHARGE);
        self.0.unary(request, path, ProstCodec::default()).await
    }
}
