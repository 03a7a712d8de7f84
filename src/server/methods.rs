//! The closed set of method labels for passed-through calls.
//!
//! Invariant: a label is one of [`ENGINE_METHODS`] or [`OTHER`], whatever
//! path a client sends, so the pass-through metric has a bounded number of
//! series. The set is every RPC of the engine services in the published
//! router protos (`smg-grpc-proto` 0.4.28), except `SubscribeKvEvents`,
//! which kvgate serves itself.

/// The label of every path outside [`ENGINE_METHODS`].
pub(crate) const OTHER: &str = "other";

/// Full method paths of the known engine services, sorted (for binary search).
pub(crate) const ENGINE_METHODS: [&str; 42] = [
    "/sglang.grpc.scheduler.SglangScheduler/Abort",
    "/sglang.grpc.scheduler.SglangScheduler/Embed",
    "/sglang.grpc.scheduler.SglangScheduler/FlushCache",
    "/sglang.grpc.scheduler.SglangScheduler/Generate",
    "/sglang.grpc.scheduler.SglangScheduler/GetLoads",
    "/sglang.grpc.scheduler.SglangScheduler/GetModelInfo",
    "/sglang.grpc.scheduler.SglangScheduler/GetServerInfo",
    "/sglang.grpc.scheduler.SglangScheduler/GetTokenizer",
    "/sglang.grpc.scheduler.SglangScheduler/HealthCheck",
    "/sglang.grpc.scheduler.SglangScheduler/ListLoadedLoRAAdapters",
    "/sglang.grpc.scheduler.SglangScheduler/LoadLoRAAdapter",
    "/sglang.grpc.scheduler.SglangScheduler/StartProfile",
    "/sglang.grpc.scheduler.SglangScheduler/StopProfile",
    "/sglang.grpc.scheduler.SglangScheduler/UnloadLoRAAdapter",
    "/tokenspeed.grpc.scheduler.TokenSpeedScheduler/Abort",
    "/tokenspeed.grpc.scheduler.TokenSpeedScheduler/FlushCache",
    "/tokenspeed.grpc.scheduler.TokenSpeedScheduler/Generate",
    "/tokenspeed.grpc.scheduler.TokenSpeedScheduler/GetLoads",
    "/tokenspeed.grpc.scheduler.TokenSpeedScheduler/GetModelInfo",
    "/tokenspeed.grpc.scheduler.TokenSpeedScheduler/GetServerInfo",
    "/tokenspeed.grpc.scheduler.TokenSpeedScheduler/GetTokenizer",
    "/tokenspeed.grpc.scheduler.TokenSpeedScheduler/HealthCheck",
    "/tokenspeed.grpc.scheduler.TokenSpeedScheduler/StartProfile",
    "/tokenspeed.grpc.scheduler.TokenSpeedScheduler/StopProfile",
    "/trtllm.TrtllmService/Abort",
    "/trtllm.TrtllmService/Embed",
    "/trtllm.TrtllmService/Generate",
    "/trtllm.TrtllmService/GetModelInfo",
    "/trtllm.TrtllmService/GetServerInfo",
    "/trtllm.TrtllmService/GetTokenizer",
    "/trtllm.TrtllmService/HealthCheck",
    "/vllm.grpc.engine.VllmEngine/Abort",
    "/vllm.grpc.engine.VllmEngine/Embed",
    "/vllm.grpc.engine.VllmEngine/FlushCache",
    "/vllm.grpc.engine.VllmEngine/Generate",
    "/vllm.grpc.engine.VllmEngine/GetLoads",
    "/vllm.grpc.engine.VllmEngine/GetModelInfo",
    "/vllm.grpc.engine.VllmEngine/GetServerInfo",
    "/vllm.grpc.engine.VllmEngine/GetTokenizer",
    "/vllm.grpc.engine.VllmEngine/HealthCheck",
    "/vllm.grpc.engine.VllmEngine/StartProfile",
    "/vllm.grpc.engine.VllmEngine/StopProfile",
];

/// The metric label of a passed-through call to `path`.
pub(crate) fn label(path: &str) -> &'static str {
    ENGINE_METHODS
        .binary_search(&path)
        .map_or(OTHER, |index| ENGINE_METHODS[index])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_engine_methods_are_sorted_and_distinct() {
        assert!(ENGINE_METHODS.windows(2).all(|pair| pair[0] < pair[1]));
    }

    #[test]
    fn a_known_method_is_its_own_label_and_any_other_path_is_other() {
        let generate = "/vllm.grpc.engine.VllmEngine/Generate";
        assert_eq!(label(generate), generate);
        assert_eq!(label("/vllm.grpc.engine.VllmEngine/Made-up"), OTHER);
        assert_eq!(label(&"x".repeat(4000)), OTHER);
        assert_eq!(
            label("/sglang.grpc.scheduler.SglangScheduler/SubscribeKvEvents"),
            OTHER
        );
    }
}
