# SGLang 0.5.23's own SchedulerLoadPublisher (unmodified, from the wheel),
# driven like a scheduler loop with a steady load; plus a bare KV PUB.
import sys, types, json, time
sys.path.insert(0, sys.argv[1])  # the unpacked sglang==0.5.23 wheel (see tests/fixtures/load)
rc = types.ModuleType("sglang.srt.runtime_context")
class P:
    pp_rank = 0; attn_tp_rank = 0; attn_cp_rank = 0; attn_dp_size = 1; attn_dp_rank = 0; dp_rank = 0; num_dp_ranks = 1
rc.get_parallel = lambda: P()
sys.modules["sglang.srt.runtime_context"] = rc
import zmq
from sglang.srt.managers.scheduler_components import load_publisher as lp
kv = zmq.Context.instance().socket(zmq.PUB); kv.bind("tcp://*:25557")
pub = lp.SchedulerLoadPublisher(kv_events_config=json.dumps({"publisher": "zmq", "endpoint": "tcp://*:25557"}),
                                load_publish_endpoint="auto")
assert pub.enable
class S: pass
s = S()
s.num_running_reqs = 3; s.num_waiting_reqs = 1; s.num_used_tokens = 1024; s.max_total_num_tokens = 4096
s.num_waiting_uncached_tokens = 0; s.num_total_tokens = 1024; s.max_running_requests = 64
s.total_prefill_uncached_tokens = 0; s.total_prefill_busy_us = 0
print("load publisher bound", flush=True)
while True:
    # the idle loop force-publishes every iteration; the publisher's own
    # heartbeat throttle sends an unchanged stat once a second
    pub.publish_load_stat(lambda: s, force=True)
    time.sleep(0.01)
