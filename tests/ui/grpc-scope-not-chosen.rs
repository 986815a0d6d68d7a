// A gRPC method made idempotent before choosing whose keys they are: refused at compile
// time, with the two choices named.
use idem_runtime::grpc::Idempotency;
use idem_runtime::MemoryStore;
use tonic::{Request, Response, Status};

#[derive(Clone, PartialEq, prost::Message)]
struct Charge {
    #[prost(uint64, tag = "1")]
    cents: u64,
}

async fn charge(request: Request<Charge>) -> Result<Response<Charge>, Status> {
    let idem = Idempotency::new(MemoryStore::new());
    idem.unary("payments.charge.v1", request, |request| async move {
        Ok(Response::new(request.into_inner()))
    })
    .await
}

fn main() {
    let _ = charge;
}
