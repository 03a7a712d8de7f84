//! Command-line clients of a gateway: `kvgate tail`, `kvgate status` and
//! the load tool `kvgate bench`. They talk gRPC only, like any router would.

pub mod connect_error;
pub mod load;
pub mod shell;
pub mod status;
pub mod tail;

use tonic::codec::{Codec, Streaming};
use tonic::transport::Channel;

use crate::proto::common::{KvEventBatch, SubscribeKvEventsRequest};

/// Connects to `address` (`host:port` or `http://host:port`), which the
/// user gave as `flag`: an error names that flag and keeps the cause.
pub async fn connect(flag: &str, address: &str) -> anyhow::Result<Channel> {
    let uri = if address.contains("://") {
        address.to_owned()
    } else {
        format!("http://{address}")
    };
    Channel::from_shared(uri.clone())
        .map_err(|error| anyhow::anyhow!("{flag} {address}: {error}"))?
        .connect()
        .await
        .map_err(|error| {
            anyhow::anyhow!(
                "{flag} {address}: cannot connect: {}",
                connect_error::describe(&error)
            )
        })
}

/// A gRPC status as grpcurl shows it: the code's canonical name first
/// (`OUT_OF_RANGE: cursor 42 is older than the history`).
pub fn describe_status(status: &tonic::Status) -> String {
    use tonic::Code;
    let name = match status.code() {
        Code::Ok => "OK",
        Code::Cancelled => "CANCELLED",
        Code::Unknown => "UNKNOWN",
        Code::InvalidArgument => "INVALID_ARGUMENT",
        Code::DeadlineExceeded => "DEADLINE_EXCEEDED",
        Code::NotFound => "NOT_FOUND",
        Code::AlreadyExists => "ALREADY_EXISTS",
        Code::PermissionDenied => "PERMISSION_DENIED",
        Code::ResourceExhausted => "RESOURCE_EXHAUSTED",
        Code::FailedPrecondition => "FAILED_PRECONDITION",
        Code::Aborted => "ABORTED",
        Code::OutOfRange => "OUT_OF_RANGE",
        Code::Unimplemented => "UNIMPLEMENTED",
        Code::Internal => "INTERNAL",
        Code::Unavailable => "UNAVAILABLE",
        Code::DataLoss => "DATA_LOSS",
        Code::Unauthenticated => "UNAUTHENTICATED",
    };
    format!("{name}: {}", status.message())
}

/// Opens `SubscribeKvEvents` on `service` with a stock prost client.
pub async fn subscribe(
    channel: Channel,
    service: &str,
    start_sequence_number: u64,
) -> Result<Streaming<KvEventBatch>, tonic::Status> {
    let codec = tonic_prost::ProstCodec::<SubscribeKvEventsRequest, KvEventBatch>::default();
    subscribe_with(channel, service, start_sequence_number, codec).await
}

/// Opens `SubscribeKvEvents` on `service`, reading the batches with `codec`.
pub async fn subscribe_with<C>(
    channel: Channel,
    service: &str,
    start_sequence_number: u64,
    codec: C,
) -> Result<Streaming<C::Decode>, tonic::Status>
where
    C: Codec<Encode = SubscribeKvEventsRequest>,
    C::Decode: Send + Sync + 'static,
{
    let request = SubscribeKvEventsRequest {
        start_sequence_number,
        load_records_before_first_batch: false,
    };
    subscribe_requesting(channel, service, request, codec).await
}

/// Opens `SubscribeKvEvents` on `service` with `request` as it is.
pub async fn subscribe_requesting<C>(
    channel: Channel,
    service: &str,
    request: SubscribeKvEventsRequest,
    codec: C,
) -> Result<Streaming<C::Decode>, tonic::Status>
where
    C: Codec<Encode = SubscribeKvEventsRequest>,
    C::Decode: Send + Sync + 'static,
{
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready()
        .await
        .map_err(|error| tonic::Status::unavailable(error.to_string()))?;
    let path = format!("/{service}/SubscribeKvEvents")
        .parse()
        .map_err(|_| tonic::Status::invalid_argument(format!("bad service name {service:?}")))?;
    grpc.server_streaming(tonic::Request::new(request), path, codec)
        .await
        .map(tonic::Response::into_inner)
}
