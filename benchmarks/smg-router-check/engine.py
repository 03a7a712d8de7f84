# A stand-in SGLang gRPC engine for the SMG router check: answers model and
# server info, health, and GetLoads (counting the calls); everything else
# UNIMPLEMENTED. Its load is steady.
import sys, time, threading, grpc
from concurrent import futures
sys.path.insert(0, sys.argv[1])  # the unpacked smg-grpc-proto==0.4.28 wheel
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb, sglang_scheduler_pb2_grpc as rpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
CALLS = {"GetLoads": 0}
class Engine(rpc.SglangSchedulerServicer):
    def HealthCheck(self, request, context):
        return pb.HealthCheckResponse(healthy=True, message="ok")
    def GetModelInfo(self, request, context):
        return pb.GetModelInfoResponse(model_path="fake/model", served_model_name="fake", is_generation=True,
                                        max_context_length=4096, vocab_size=32000, max_req_input_len=4000)
    def GetServerInfo(self, request, context):
        r = pb.GetServerInfoResponse(server_type="grpc", sglang_version="0.5.23", max_total_num_tokens=4096)
        r.server_args.update({"dp_size": 1, "page_size": 16, "model_path": "fake/model"})
        return r
    def GetLoads(self, request, context):
        CALLS["GetLoads"] += 1
        return pb.GetLoadsResponse(dp_rank_count=1, loads=[pb.SchedulerLoad(dp_rank=0, num_running_reqs=3,
            num_waiting_reqs=1, token_usage=0.25, max_running_requests=64, num_used_tokens=1024, max_total_num_tokens=4096)])
server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
rpc.add_SglangSchedulerServicer_to_server(Engine(), server)
h = health.HealthServicer(); h.set("", health_pb2.HealthCheckResponse.SERVING)
health_pb2_grpc.add_HealthServicer_to_server(h, server)
port = server.add_insecure_port("127.0.0.1:0")
server.start()
print("PORT", port, flush=True)
while True:
    time.sleep(5)
    print("GetLoads calls", CALLS["GetLoads"], flush=True)
