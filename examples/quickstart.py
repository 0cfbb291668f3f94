"""fp32keep in one screen: a tiny T5 trained in fp16 under FSDP2 keeps its `wo` weights in FP32.

Run: torchrun --standalone --nproc-per-node=2 examples/quickstart.py
(gloo on CPU; NCCL with one GPU per rank when CUDA is available).
"""

import gc

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from transformers import T5Config, T5ForConditionalGeneration

import fp32keep

cuda = torch.cuda.is_available()
dist.init_process_group("nccl" if cuda else "gloo")
rank = dist.get_rank()
if cuda:
    torch.cuda.set_device(rank % torch.cuda.device_count())
device = "cuda" if cuda else "cpu"
mesh = init_device_mesh(device, (dist.get_world_size(),))

# Rank 0 builds the model for real and holds the checkpoint; the other ranks build it on meta.
config = T5Config(
    vocab_size=128,
    d_model=64,
    d_kv=16,
    d_ff=128,
    num_layers=2,
    num_heads=4,
    decoder_start_token_id=0,
)
with torch.device(device if rank == 0 else "meta"):
    model = T5ForConditionalGeneration(config)
checkpoint = {k: v.clone() for k, v in model.state_dict().items()} if rank == 0 else None
batch = {"input_ids": torch.randint(0, 128, (2, 8), device=device)}
batch["labels"] = batch["input_ids"]

plan = fp32keep.resolve_keep_plan(model, torch.float16)  # T5 keeps `wo` under fp16
fp32keep.keep_aware_cast(model, torch.float16, plan=plan)  # instead of model.to(torch.float16)
policy = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
# validates, then shards, laid out from one forward on the batch (run by rank 0, the real one)
fp32keep.apply_fsdp2(model, mesh=mesh, mp_policy=policy, plan=plan, example_inputs=batch)
fp32keep.load_full_state_dict(model, checkpoint)  # destination dtype wins

loss = model(**batch).loss
loss.backward()

wo = model.encoder.block[0].layer[1].DenseReluDense.wo.weight
if rank == 0:
    print(plan.describe())
    print(
        f"loss {loss.item():.4f}; stored wo shard: {wo.to_local().dtype}; "
        f"other weights: {model.shared.weight.to_local().dtype}"
    )
# FSDP2 modules sit in reference cycles: free them while the process group is alive. Left to
# interpreter exit, their collection can abort the process (torch 2.13, gloo: "terminate called
# without an active exception", about 1 exit in 13).
del model, loss, wo
gc.collect()
dist.barrier()  # every rank done with its last collective before the group goes away
dist.destroy_process_group()
