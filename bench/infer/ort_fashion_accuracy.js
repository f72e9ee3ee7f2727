// ONNX Runtime's Fashion-MNIST test accuracy of an exported model (docs/quantization.md, "QDQ export and
// int8 inference"): the 10,000 test images as kiln reads them (x / 255), batches of 500, 1 thread.
//
//   NODE_PATH=/usr/local/share/kiln/npm/node_modules node bench/infer/ort_fashion_accuracy.js RUN/model.int8.onnx
const ort = require('onnxruntime-node');
const fs = require('fs');
const zlib = require('zlib');
const [model] = process.argv.slice(2);
const img = zlib.gunzipSync(fs.readFileSync('/usr/share/datasets/fashion-mnist/t10k-images-idx3-ubyte.gz')).subarray(16);
const lab = zlib.gunzipSync(fs.readFileSync('/usr/share/datasets/fashion-mnist/t10k-labels-idx1-ubyte.gz')).subarray(8);
(async () => {
  const s = await ort.InferenceSession.create(model, {intraOpNumThreads: 1});
  let right = 0;
  const n = lab.length, B = 500;
  for (let b = 0; b < n; b += B) {
    const x = new Float32Array(B * 784);
    for (let i = 0; i < B * 784; ++i) x[i] = img[b * 784 + i] / 255;
    const y = (await s.run({input: new ort.Tensor('float32', x, [B, 1, 28, 28])})).output.data;
    const k = y.length / B;
    for (let i = 0; i < B; ++i) {
      let best = 0;
      for (let j = 1; j < k; ++j) if (y[i * k + j] > y[i * k + best]) best = j;
      if (best === lab[b + i]) ++right;
    }
  }
  console.log(model, 'onnxruntime test accuracy', (100 * right / n).toFixed(2) + '%');
})();
