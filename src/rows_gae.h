/* -- GAE --------------------------------------------------------------------------------------- */
/* Twin of _gae_rows (ppo_fast/_numba_kernels.py). The running state is float64 whatever the
 * dtype. Included by rows.h, once per dtype. */

static void PPO_ROW(ppo_gae_row)(
    const ppo_real* rewards, const ppo_real* values, ptrdiff_t start, ptrdiff_t span,
    ptrdiff_t length, const uint8_t* mask, int has_mask, double gamma, double lam,
    double next_value, ppo_real* advantages, ppo_real* returns) {
    double gamma_lam = gamma * lam, running = 0.0;
    for (ptrdiff_t t = span - 1; t >= 0; t--) {
        ptrdiff_t i = start + t;
        if (t < length && (!has_mask || mask[i] != 0)) {
            double value = values[i];
            /* One rounding per multiply-add, as the twin's llvm.fma: the same bits as numba, and
             * the running advantage is a latency-bound chain, where a fused op halves the
             * latency. */
            double delta = fma(gamma, next_value, (double)rewards[i]) - value;
            running = fma(gamma_lam, running, delta);
            advantages[i] = (ppo_real)running;
            returns[i] = (ppo_real)(running + value);
            next_value = value;
        } else {
            advantages[i] = 0;
            returns[i] = 0;
        }
    }
}
