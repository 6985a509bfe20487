// STREAM triad: out = b + s * c, float4 loads and stores in a grid-stride loop.
// Inputs: b, c (float32, length b_shape[0], a multiple of 4), s (float32 scalar).
// Output: out (same shape as b). Bytes moved: 3 * b_shape[0] * 4.
uint gid = thread_position_in_grid.x;
uint stride = threads_per_grid.x;
uint n4 = uint(b_shape[0]) / 4;
const device float4* b4 = reinterpret_cast<const device float4*>(b);
const device float4* c4 = reinterpret_cast<const device float4*>(c);
device float4* out4 = reinterpret_cast<device float4*>(out);
for (uint i = gid; i < n4; i += stride) {
    out4[i] = fma(float4(s), c4[i], b4[i]);
}
