//! `GetLoads` on the engine's own gRPC server, under whichever engine
//! service it serves.
//!
//! The calls share the pass-through's HTTP/2 connection pool to the engine
//! (`--engine-grpc`), so kvgate's polls and the routers' forwarded calls
//! reach the engine the same way.

use std::time::Duration;

use tonic::Status;

use super::answer::{self, Faults, RankLoad};
use crate::client::EngineTransport;
use crate::proto::sglang::grpc::scheduler as sglang;
use crate::proto::tokenspeed::grpc::scheduler as tokenspeed;
use crate::proto::vllm::grpc::engine as vllm;

/// The engine behind `--engine-grpc`, as `--engine-kind` names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum EngineKind {
    Sglang,
    Vllm,
    Trtllm,
    Tokenspeed,
}

impl EngineKind {
    /// The service kvgate polls for this engine; TensorRT-LLM's service has
    /// no `GetLoads` (smg-grpc-proto 0.4.28).
    pub fn load_service(self) -> Option<LoadService> {
        match self {
            Self::Sglang => Some(LoadService::Sglang),
            Self::Vllm => Some(LoadService::Vllm),
            Self::Tokenspeed => Some(LoadService::TokenSpeed),
            Self::Trtllm => None,
        }
    }
}

/// An engine service that answers `GetLoads`, each with its own messages.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LoadService {
    Sglang,
    Vllm,
    TokenSpeed,
}

impl LoadService {
    /// The order in which detection tries them.
    pub const ALL: [Self; 3] = [Self::Sglang, Self::Vllm, Self::TokenSpeed];

    pub fn name(self) -> &'static str {
        match self {
            Self::Sglang => "sglang.grpc.scheduler.SglangScheduler",
            Self::Vllm => "vllm.grpc.engine.VllmEngine",
            Self::TokenSpeed => "tokenspeed.grpc.scheduler.TokenSpeedScheduler",
        }
    }
}

/// The engine's gRPC server, for kvgate's own calls.
#[derive(Clone)]
pub struct EngineLoads {
    transport: EngineTransport,
    origin: http::Uri,
    timeout: Duration,
}

impl EngineLoads {
    pub fn new(transport: EngineTransport, origin: http::Uri, timeout: Duration) -> Self {
        Self {
            transport,
            origin,
            timeout,
        }
    }

    /// One `GetLoads` on `service`, every rank and every section, within
    /// the poll timeout (`DEADLINE_EXCEEDED` past it).
    pub async fn get_loads(
        &self,
        service: LoadService,
        faults: &mut Faults,
    ) -> Result<Vec<RankLoad>, Status> {
        let call = self.call(service, faults);
        match tokio::time::timeout(self.timeout, call).await {
            Ok(answer) => answer,
            Err(_) => Err(Status::deadline_exceeded(format!(
                "GetLoads took over {:?}",
                self.timeout
            ))),
        }
    }

    async fn call(
        &self,
        service: LoadService,
        faults: &mut Faults,
    ) -> Result<Vec<RankLoad>, Status> {
        let (transport, origin) = (self.transport.clone(), self.origin.clone());
        let request = |include: &[&str]| {
            let mut request =
                tonic::Request::new(include.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>());
            request.set_timeout(self.timeout);
            request
        };
        match service {
            LoadService::Sglang => {
                let mut client =
                    sglang::sglang_scheduler_client::SglangSchedulerClient::with_origin(
                        transport, origin,
                    );
                let include = request(&["all"]).map(|include| sglang::GetLoadsRequest {
                    dp_rank: None,
                    include,
                });
                let answer = client.get_loads(include).await?.into_inner();
                Ok(answer::from_sglang(answer, faults))
            }
            LoadService::Vllm => {
                let mut client =
                    vllm::vllm_engine_client::VllmEngineClient::with_origin(transport, origin);
                // vLLM reports the core section only.
                let include = request(&[]).map(|include| vllm::GetLoadsRequest {
                    dp_rank: None,
                    include,
                });
                let answer = client.get_loads(include).await?.into_inner();
                Ok(answer::from_vllm(answer, faults))
            }
            LoadService::TokenSpeed => {
                let mut client = tokenspeed::token_speed_scheduler_client::TokenSpeedSchedulerClient::with_origin(transport, origin);
                let include = request(&["all"]).map(|include| tokenspeed::GetLoadsRequest {
                    dp_rank: None,
                    include,
                });
                let answer = client.get_loads(include).await?.into_inner();
                Ok(answer::from_tokenspeed(answer, faults))
            }
        }
    }
}
