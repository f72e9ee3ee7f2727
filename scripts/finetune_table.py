"""The fine-tuning table of docs/finetuning.md from the run directories that
scripts/finetune_figures.sh writes (runs/sherlock_<method>_lr<lr>): for every
run, held-out bits/char (the last evaluation), its improvement over the base and
its share of the best full fine-tune's improvement, trainable parameters (those
with optimizer state in the last checkpoint) of all (adapters included, NF4
weights counted by element), optimizer-state bytes (the checkpoint's), peak
memory by category (the train lines' peaks) and seconds per step (train lines'
time over steps; noisy on a shared machine). Each method's best learning rate
is in bold.

    finetune_table.py [RUNS_DIR]
"""
import glob, json, os, struct, sys

R = sys.argv[1] if len(sys.argv) > 1 else "runs"
# (directory key, label); every learning rate found for a key is a row.
METHODS = [
    ("full", "full fine-tune"),
    ("r4_all", "LoRA r=4, every block Linear"),
    ("r8_all", "LoRA r=8, every block Linear"),
    ("r16_all", "LoRA r=16, every block Linear"),
    ("qlora_r8_all", "QLoRA r=8 (NF4 base), every block Linear"),
    ("r2_all", "LoRA r=2, every block Linear"),
    ("r8_cattn", "LoRA r=8, attn.c_attn only"),
    ("r4_attn", "LoRA r=4, attn.c_attn + attn.c_proj"),
    ("r1_all", "LoRA r=1, every block Linear"),
    ("r1_all_biasall", "LoRA r=1, every block Linear, bias = all"),
    ("r2_all_biasall", "LoRA r=2, every block Linear, bias = all"),
]


def header(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return json.loads(f.read(n))


def numel(v):
    n = 1
    for s in v["shape"]:
        n *= s
    return n


def mib(b):
    return "%.2f" % (b / 2**20)


def measure(d, base=False):
    lines = [json.loads(l) for l in open(os.path.join(d, "metrics.jsonl"))]
    ev = [l for l in lines if l["kind"] == "eval"]
    tr = [l for l in lines if l["kind"] == "train"]
    ckd = os.path.join(d, "checkpoints")
    if base:  # no training step that counts: the model is init_from's
        ckd = os.path.join(R, "gpt_mobydick", "checkpoints")
    ck = sorted(c for c in os.listdir(ckd) if c.startswith("ckpt-"))
    h = header(os.path.join(ckd, ck[-1]))
    model = {k[len("model."):]: v for k, v in h.items() if k.startswith("model.")}
    opt_bytes = sum(v["data_offsets"][1] - v["data_offsets"][0] for k, v in h.items()
                    if k.startswith("optim.") and v["dtype"] in ("F32", "F64"))
    trained = {k[len("optim."):-len(".exp_avg")] for k in h if k.startswith("optim.") and k.endswith(".exp_avg")}
    total = 0
    for name, v in model.items():
        if name == "lm_head.weight":
            continue  # tied to transformer.wte.weight
        if ".weight_nf4_" in name:
            if name.endswith("weight_nf4_codes"):
                total += 2 * numel(v)  # two 4-bit codes a byte
            continue
        total += numel(v)
    ntrain = sum(numel(model[n]) for n in trained)
    peak = {}
    for l in tr:
        for c, b in l["memory"].items():
            peak[c] = max(peak.get(c, 0), b)
    # step time: wall time between the first and last train lines over their steps (the first window warms up)
    st = (tr[-1]["time_s"] - tr[0]["time_s"]) / (tr[-1]["step"] - tr[0]["step"]) if len(tr) >= 2 else float("nan")
    return dict(bpc=ev[-1]["bits_per_char"], step=ev[-1]["step"], ntrain=ntrain, total=total, opt=opt_bytes,
                peak=peak, st=st)


base_dir = os.path.join(R, "sherlock_base")
if not os.path.isdir(base_dir):
    sys.exit("finetune_table.py: no %s (run scripts/finetune_figures.sh)" % base_dir)
base = measure(base_dir, base=True)
rows = []
for key, label in METHODS:
    runs = []
    for d in glob.glob(os.path.join(R, "sherlock_%s_lr*" % key)):
        if not os.path.exists(os.path.join(d, "summary.json")):
            continue
        lr = d.rsplit("_lr", 1)[1]
        runs.append((float(lr), lr, measure(d)))
    runs.sort()
    best = min((r[2]["bpc"] for r in runs), default=None)
    for _, lr, m in runs:
        rows.append((key, label, lr, m, m["bpc"] == best))
full = [r for r in rows if r[0] == "full"]
gain_full = base["bpc"] - min(r[3]["bpc"] for r in full) if full else None

print("| run | lr | held-out bits/char | improvement | of full FT's | trainable params (fraction) "
      "| optimizer state | peak memory MiB: parameter / gradient / optimizer / activation / workspace | step time |")
print("|---|---|---|---|---|---|---|---|---|")
print("| base (Moby-Dick GPT, no fine-tuning) | — | %.3f | — | — | — | — | — | — |" % base["bpc"])
for key, label, lr, m, is_best in rows:
    gain = base["bpc"] - m["bpc"]
    b = "**" if is_best else ""
    share = "%s%.0f%%%s" % (b, 100 * gain / gain_full, b) if gain_full else "—"
    p = m["peak"]
    print("| %s | %s | %s%.3f%s | %.3f | %s | %d of %d (%.2f%%) | %s MiB | %s / %s / %s / %s / %s | %s |" % (
        label, lr, b, m["bpc"], b, gain, share, m["ntrain"], m["total"], 100.0 * m["ntrain"] / m["total"],
        mib(m["opt"]), mib(p.get("parameter", 0)), mib(p.get("gradient", 0)), mib(p.get("optimizer_state", 0)),
        mib(p.get("activation", 0)), mib(p.get("workspace", 0)), "—" if m["st"] != m["st"] else "%.2f s" % m["st"]))
