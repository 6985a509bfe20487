// FMA throughput: each thread runs `iterations` rounds of 4 independent float4 FMA chains
// x = x * m + k (registers only, no memory traffic), then stores the sum of its chains.
// Inputs: seed (float32, one per thread), m, k (float32 scalars), iterations (int32 scalar).
// Output: out (float32, one per thread). FLOP: threads * iterations * 4 chains * 4 lanes * 2.
uint gid = thread_position_in_grid.x;
float x0 = seed[gid];
float4 x1 = float4(x0, x0 + 1.0f, x0 + 2.0f, x0 + 3.0f);
float4 x2 = x1 + 0.25f;
float4 x3 = x1 + 0.5f;
float4 x4 = x1 + 0.75f;
float4 mm = float4(m);
float4 kk = float4(k);
for (int i = 0; i < iterations; ++i) {
    x1 = fma(x1, mm, kk);
    x2 = fma(x2, mm, kk);
    x3 = fma(x3, mm, kk);
    x4 = fma(x4, mm, kk);
}
float4 total = x1 + x2 + x3 + x4;
out[gid] = total.x + total.y + total.z + total.w;
