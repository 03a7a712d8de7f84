//! `kvgate.v1.KvIndex/Match`: the prefix index's overlap query over gRPC,
//! on `kvgate index`'s port (beside Dynamo's HTTP API) and on `kvgate serve
//! --index`'s gRPC port (beside `SubscribeKvEvents`).
//!
//! Invariants: the answer is [`Registry::answer`]'s, the one that `/query`
//! and `/query_by_hash` translate to JSON, translated here to protobuf and
//! nothing else. A refusal carries the code a router can act on: NOT_FOUND
//! for a partition the index does not hold, INVALID_ARGUMENT for a request
//! that asks nothing or mixes a salt into given hashes, RESOURCE_EXHAUSTED
//! naming the limit for one over [`QUERY_BODY_LIMIT_BYTES`] or
//! [`MAX_MATCH_BLOCKS`] (never OUT_OF_RANGE, which tells a router to drop
//! its cursor). An oversized message is refused from its declared length,
//! before its bytes are buffered.

use std::convert::Infallible;
use std::sync::Arc;
use std::task::{Context, Poll};

use futures::future::BoxFuture;
use tonic::server::{Grpc, UnaryService};
use tonic::{Request, Response, Status};
use tonic_prost::ProstCodec;

use super::index_http::{HASHES_TAKE_NO_SALT, QUERY_BODY_LIMIT_BYTES};
use super::request_limit::LimitedRequest;
use crate::index::block_hash::HashSeed;
use crate::index::overlap::{Answer, QueryBlocks, RankTokens};
use crate::index::partition::PartitionKey;
use crate::index::registry::{DEFAULT_ROUTING_GROUP, Registry};
use crate::proto::kvgate::v1::match_request::Query;
use crate::proto::kvgate::v1::{MatchRequest, MatchResponse, RankMatch, WorkerMatch};

/// The service's name, as reflection lists it.
pub const SERVICE: &str = "kvgate.v1.KvIndex";

/// The one method's path.
pub const MATCH_PATH: &str = "/kvgate.v1.KvIndex/Match";

/// The most token ids or block hashes one `Match` may carry: the million
/// tokens Dynamo's 8 MiB `/query` body is sized for. Token ids can be
/// packed into far fewer bytes than JSON takes, so the message size alone
/// would let through several million.
pub const MAX_MATCH_BLOCKS: usize = 1 << 20;

/// The route of `Match`, answering from `registry`.
pub fn routes(registry: Arc<Registry>) -> axum::Router {
    axum::Router::new().route_service(MATCH_PATH, MatchService { registry })
}

/// The HTTP-level service mounted at [`MATCH_PATH`].
#[derive(Clone)]
struct MatchService {
    registry: Arc<Registry>,
}

impl tower::Service<http::Request<axum::body::Body>> for MatchService {
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = BoxFuture<'static, Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<axum::body::Body>) -> Self::Future {
        let call = Match(Arc::clone(&self.registry));
        let request = request.map(|body| LimitedRequest::new(body, QUERY_BODY_LIMIT_BYTES));
        Box::pin(async move {
            // The request's size is `LimitedRequest`'s to refuse (tonic's
            // own check would answer OUT_OF_RANGE).
            let mut grpc = Grpc::new(ProstCodec::<MatchResponse, MatchRequest>::default())
                .max_decoding_message_size(usize::MAX);
            Ok(grpc.unary(call, request).await)
        })
    }
}

/// One call, answered from the registry.
struct Match(Arc<Registry>);

impl UnaryService<MatchRequest> for Match {
    type Response = MatchResponse;
    type Future = std::future::Ready<Result<Response<MatchResponse>, Status>>;

    fn call(&mut self, request: Request<MatchRequest>) -> Self::Future {
        std::future::ready(answer(&self.0, request.into_inner()).map(Response::new))
    }
}

fn answer(registry: &Registry, request: MatchRequest) -> Result<MatchResponse, Status> {
    if request.model_name.is_empty() {
        return Err(Status::invalid_argument("model_name is required"));
    }
    let too_many = |what: &str, count: usize| {
        Status::resource_exhausted(format!(
            "{count} {what} is over kvgate's limit of {MAX_MATCH_BLOCKS} per Match (the million tokens of /query's {QUERY_BODY_LIMIT_BYTES}-byte body)"
        ))
    };
    let blocks = match &request.query {
        Some(Query::TokenIds(tokens)) if tokens.ids.len() > MAX_MATCH_BLOCKS => {
            return Err(too_many("token ids", tokens.ids.len()));
        }
        Some(Query::TokenIds(tokens)) => QueryBlocks::Tokens {
            token_ids: &tokens.ids,
            seed: HashSeed::new(Some(&request.lora_name), Some(&request.cache_salt)),
        },
        Some(Query::BlockHashes(hashes)) if hashes.hashes.len() > MAX_MATCH_BLOCKS => {
            return Err(too_many("block hashes", hashes.hashes.len()));
        }
        Some(Query::BlockHashes(_)) if !request.cache_salt.is_empty() => {
            return Err(Status::invalid_argument(HASHES_TAKE_NO_SALT));
        }
        Some(Query::BlockHashes(_)) if !request.lora_name.is_empty() => {
            return Err(Status::invalid_argument(
                "lora_name is not accepted with block_hashes; they must already include the adapter",
            ));
        }
        Some(Query::BlockHashes(hashes)) => QueryBlocks::Hashes(&hashes.hashes),
        None => {
            return Err(Status::invalid_argument(
                "a Match needs token_ids or block_hashes",
            ));
        }
    };
    let routing_group = if request.routing_group.is_empty() {
        DEFAULT_ROUTING_GROUP.to_owned()
    } else {
        request.routing_group.clone()
    };
    let key = PartitionKey {
        model_name: request.model_name.clone(),
        routing_group,
    };
    registry
        .answer(&key, blocks)
        .map(translate)
        .map_err(|unknown| Status::not_found(unknown.to_string()))
}

/// The answer as protobuf: each worker's summary with its ranks' depths.
fn translate(answer: Answer) -> MatchResponse {
    let block_size = answer.block_size;
    let workers = answer
        .overlap
        .workers
        .iter()
        .map(|summary| WorkerMatch {
            worker_id: summary.worker,
            longest_matched_tokens: summary.longest_matched,
            device_tokens: summary.gpu,
            host_tokens: summary.cpu,
            disk_tokens: summary.disk,
            ranks: answer.ranks[summary.ranks.clone()]
                .iter()
                .map(|found| {
                    let [device, host, disk, external] = found.blocks;
                    let tokens = RankTokens::of(found, block_size);
                    RankMatch {
                        dp_rank: found.key.rank,
                        device_blocks: device,
                        host_blocks: host,
                        disk_blocks: disk,
                        external_blocks: external,
                        device_tokens: tokens.device,
                        matched_tokens: tokens.all,
                    }
                })
                .collect(),
        })
        .collect();
    MatchResponse {
        block_size,
        workers,
    }
}
