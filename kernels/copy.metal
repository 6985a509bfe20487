// Copy: out = a, float4 loads and stores in a grid-stride loop.
// Inputs: a (float32, length a_shape[0], a multiple of 4). Output: out (same shape).
// Bytes moved: 2 * a_shape[0] * 4.
uint gid = thread_position_in_grid.x;
uint stride = threads_per_grid.x;
uint n4 = uint(a_shape[0]) / 4;
const device float4* a4 = reinterpret_cast<const device float4*>(a);
device float4* out4 = reinterpret_cast<device float4*>(out);
for (uint i = gid; i < n4; i += stride) {
    out4[i] = a4[i];
}
