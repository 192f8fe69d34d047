import gc, weakref, torch, sys
from pathlib import Path
from deepshard.testing import run_on_mesh
from deepshard.interface import Topology
SHAPE = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
def one(mesh, tp):
    from transformers import LlamaConfig, LlamaForCausalLM
    import deepshard.engine as ds
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SHAPE))
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 3}}
    if tp > 1: cfg["tensor_parallel"] = {"autotp_size": tp}
    engine, *_ = ds.initialize(model, cfg, mesh=mesh)
    ids = torch.randint(0, 64, (2, 8))
    engine.backward(engine(input_ids=ids, labels=ids).loss); engine.step()
    return weakref.ref(model)
def main(mesh):
    tp = mesh.size()
    ref = one(mesh, tp); gc.collect()
    m = ref()
    if m is None: return "freed"
    out = []
    # walk referrers 3 levels
    def desc(o):
        t = type(o).__name__
        if isinstance(o, dict): return f"dict keys={list(o)[:6]}"
        if isinstance(o, (list, tuple)): return f"{t} len={len(o)}"
        return t + (" " + getattr(o, "__qualname__", "") if callable(o) else "")
    frontier = [m]; seen = {id(m)}
    for level in range(4):
        nxt = []
        for o in frontier:
            for r in gc.get_referrers(o):
                if id(r) in seen or r is frontier or r is nxt: continue
                if type(r).__name__ == "frame": continue
                seen.add(id(r)); nxt.append(r); out.append(f"L{level} {desc(r)}")
        frontier = nxt[:15]
    return out[:60]
if __name__ == '__main__':
  import tempfile
  for world in (1, 2):
    d = tempfile.mkdtemp(); res = run_on_mesh(main, world, topology=Topology(dp=1, tp=world), store_dir=Path(d), timeout_s=200)
    print(world, res[0] if isinstance(res[0], str) else "\n".join(res[0]))
