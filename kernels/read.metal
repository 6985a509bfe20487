// Streaming read: each thread sums its grid-stride share of `a` (float4 loads) into one partial.
// Inputs: a (float32, length a_shape[0], a multiple of 4). Output: partial (float32, one per thread).
// Bytes moved: a_shape[0] * 4 read, plus one float written per thread (1 MiB over the roofline's
// grid), which the roofline counts.
uint gid = thread_position_in_grid.x;
uint stride = threads_per_grid.x;
uint n4 = uint(a_shape[0]) / 4;
const device float4* a4 = reinterpret_cast<const device float4*>(a);
float4 acc = float4(0.0f);
for (uint i = gid; i < n4; i += stride) {
    acc += a4[i];
}
partial[gid] = acc.x + acc.y + acc.z + acc.w;
