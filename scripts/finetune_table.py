"""The fine-tuning table of docs/finetuning.md from the run directories that
scripts/finetune_figures.sh writes: held-out bits/char (the last evaluation),
its improvement over the base and the share of the best full fine-tune's,
trainable parameters (those with optimizer state in the last checkpoint) of
all (NF4 weights counted by element), optimizer-state bytes (the checkpoint's),
peak memory by category (the train lines' peaks), and seconds per step (train
lines' time over steps; noisy on a shared machine).

    finetune_table.py [RUNS_DIR]
"""
import json, os, struct, sys
R = sys.argv[1] if len(sys.argv) > 1 else "runs"
rows = [("base (Moby-Dick GPT, no training)", "sherlock_base"), ("full fine-tune, lr 5e-4", "sherlock_full"), ("full fine-tune, lr 1e-3", "sherlock_full_lr1e-3"),
        ("LoRA r=4", "sherlock_lora_r4"), ("LoRA r=8", "sherlock_lora_r8"), ("LoRA r=16", "sherlock_lora_r16"),
        ("QLoRA r=8 (NF4 base)", "sherlock_qlora_r8"), ("LoRA r=8, attn.c_attn only", "sherlock_lora_r8_attn"),
        ("LoRA r=8, lr 5e-3", "sherlock_lora_r8_lr5e-3"), ("LoRA r=8, lr 1e-2", "sherlock_lora_r8_lr1e-2")]

def header(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return json.loads(f.read(n))

def mib(b): return "%.2f" % (b / 2**20)

base_bpc = None
out = []
for label, d in rows:
    d = os.path.join(R, d)
    if not os.path.isdir(d): continue
    lines = [json.loads(l) for l in open(os.path.join(d, "metrics.jsonl"))]
    ev = [l for l in lines if l["kind"] == "eval"]
    tr = [l for l in lines if l["kind"] == "train"]
    bpc = ev[-1]["bits_per_char"]
    ckd = os.path.join(d, "checkpoints")
    ck = [c for c in sorted(os.listdir(ckd)) if c.startswith("ckpt-")] if os.path.isdir(ckd) else []
    if not ck:  # the base row: no training step saved; the model is init_from's
        ckd = os.path.join(R, "gpt_mobydick", "checkpoints")
        ck = [c for c in sorted(os.listdir(ckd)) if c.startswith("ckpt-")]
    h = header(os.path.join(ckd, ck[-1]))
    if label.startswith("base"):
        h = {k: v for k, v in h.items() if not k.startswith("optim.")}
    model = {k: v for k, v in h.items() if k.startswith("model.")}
    opt_bytes = sum(v["data_offsets"][1] - v["data_offsets"][0] for k, v in h.items() if k.startswith("optim.") and v["dtype"] in ("F32", "F64"))
    # trainable: parameters with optimizer state (exp_avg)
    tr_names = {k[len("optim."):-len(".exp_avg")] for k in h if k.startswith("optim.") and k.endswith(".exp_avg")}
    def numel(v):
        n = 1
        for s in v["shape"]: n *= s
        return n
    total = 0
    for k, v in model.items():
        name = k[len("model."):]
        if name == "lm_head.weight": continue  # tied to transformer.wte.weight
        if ".weight_nf4_" in name:
            if name.endswith("weight_nf4_codes"): total += 2 * numel(v)
            continue
        total += numel(v)
    ntrain = sum(numel(model["model." + n]) for n in tr_names)
    if label.startswith("base"):
        ntrain = 0
    peak = {}
    for l in tr:
        for c, b in l["memory"].items(): peak[c] = max(peak.get(c, 0), b)
    # step time: wall time of the train lines' windows over steps (after the first window: warm-up)
    if len(tr) >= 2:
        st = (tr[-1]["time_s"] - tr[0]["time_s"]) / (tr[-1]["step"] - tr[0]["step"])
    else:
        st = float("nan")
    if base_bpc is None: base_bpc = bpc
    out.append((label, bpc, ntrain, total, opt_bytes, peak, st, ev[-1]["step"]))
full = [o for o in out if o[0].startswith("full fine-tune")]
full = [min(full, key=lambda o: o[1])] if full else full  # the better full fine-tune is the reference
gain_full = base_bpc - full[0][1] if full else None
print("| run | steps | held-out bits/char | improvement | of full FT's | trainable params (fraction) | optimizer state | peak memory MiB: parameter / gradient / optimizer / activation / workspace | step time |")
print("|---|---|---|---|---|---|---|---|---|")
for label, bpc, ntrain, total, ob, peak, st, step in out:
    gain = base_bpc - bpc
    if label.startswith("base"):
        print("| %s | 0 | %.3f | — | — | — | — | — | — |" % (label, bpc))
        continue
    rel = "%.0f%%" % (100 * gain / gain_full) if gain_full and not label.startswith("base") else "—"
    print("| %s | %d | %.3f | %.3f | %s | %d of %d (%.2f%%) | %s MiB | %s / %s / %s / %s / %s | %s |" % (
        label, step, bpc, gain, rel, ntrain, total, 100.0 * ntrain / total, mib(ob),
        mib(peak.get("parameter", 0)), mib(peak.get("gradient", 0)), mib(peak.get("optimizer_state", 0)),
        mib(peak.get("activation", 0)), mib(peak.get("workspace", 0)),
        "—" if st != st else "%.2f s" % st))
