// ONNX Runtime's side of the inference rows (scripts/bench.sh, bench/infer.py):
// times onnxruntime-node on the model and input kiln_bench_infer wrote, and
// prints one JSON line per workload like kiln_bench_infer's.
//
//   NODE_PATH=/usr/local/share/kiln/npm/node_modules node ort_bench.js DIR cnn[,resnet,...] THREADS WARMUP STEPS
//
// Session options: intra-op threads = THREADS, one inter-op thread, sequential
// execution, all graph optimisations (ORT's default level, with its own
// Conv+Relu / MatMul+Add / GELU / LayerNorm fusions): ORT at its best on a CPU.
// Each timed batch is one awaited session.run. The output is compared with
// kiln's eager output (NAME.kiln.bin), relative to its largest magnitude.
const ort = require('onnxruntime-node');
const fs = require('fs');

const [dir, names, threads, warmup, steps] = process.argv.slice(2);
const shapes = {
  cnn: [64, 1, 28, 28], resnet: [32, 3, 32, 32], gpt_infer: [1, 128],
  cnn_int8: [64, 1, 28, 28], resnet_int8: [64, 3, 32, 32],
};

function read(path, type) {
  const bytes = new Uint8Array(fs.readFileSync(path)).buffer;  // a fresh, aligned copy
  return type === 'int64' ? new BigInt64Array(bytes) : new Float32Array(bytes);
}

function median(v) {
  const s = [...v].sort((a, b) => a - b);
  const n = s.length;
  return n % 2 ? s[(n - 1) / 2] : 0.5 * (s[n / 2 - 1] + s[n / 2]);
}

(async () => {
  for (const name of names.split(',')) {
    const type = name === 'gpt_infer' ? 'int64' : 'float32';
    const session = await ort.InferenceSession.create(dir + '/' + name + '.onnx', {
      intraOpNumThreads: Number(threads),
      interOpNumThreads: 1,
      executionMode: 'sequential',
      graphOptimizationLevel: 'all',
    });
    const feeds = {input: new ort.Tensor(type, read(dir + '/' + name + '.input.bin', type), shapes[name])};
    let out = null;
    for (let i = 0; i < Number(warmup); ++i) out = await session.run(feeds);
    const ms = [];
    for (let i = 0; i < Number(steps); ++i) {
      const t0 = process.hrtime.bigint();
      out = await session.run(feeds);
      ms.push(Number(process.hrtime.bigint() - t0) / 1e6);
    }
    const got = out.output.data, want = read(dir + '/' + name + '.kiln.bin', 'float32');
    let scale = 0, diff = 0;
    for (let i = 0; i < want.length; ++i) {
      scale = Math.max(scale, Math.abs(want[i]));
      diff = Math.max(diff, Math.abs(got[i] - want[i]));
    }
    if (got.length !== want.length) diff = Infinity;
    console.log(JSON.stringify({
      framework: 'onnxruntime', workload: name, threads: Number(threads), warmup: Number(warmup),
      steps: Number(steps), median_ms: median(ms), max_rel_diff_vs_eager: diff / Math.max(scale, 1e-30),
      ort_version: ort.env.versions ? ort.env.versions.common : null, step_ms: ms,
    }));
  }
})().catch((e) => { console.error('ort_bench: ' + e); process.exit(1); });
