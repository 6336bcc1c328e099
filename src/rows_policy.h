/* Twins of reinforce, cispo and sapo (ppo_fast/_numba_losses.py), operation for operation.
 * Included by rows.h, once per dtype.
 *
 * Eight lanes at a time, as the clipped surrogate (rows_loss.h): a row's valid prefix in chunks of
 * PPO_CHUNK tokens, the chunk's exps first into scratch rows (the ratios, and SAPO's sigmoids),
 * then the rest 8 tokens at a time, a row's last partial block in zero-padded invalid lanes.
 * Per-token arithmetic runs in the dtype; the weight is float64 (numba's is, either way), so the
 * gradient's -weight * slope * scale is a float64 product, rounded to the dtype at the store.
 * Every sum is float64, in 8 lanes added up in a fixed tree (an order of its own, but the same on
 * any number of threads), and every count an integer. An invalid position (past the length, or
 * masked) gets a zero gradient and adds a zero term to each sum, as the twins' selects: whatever
 * is stored there (NaN, inf) reaches nothing. */

#ifndef PPO_FAST_FAMILY_KINDS
#define PPO_FAST_FAMILY_KINDS
enum { PPO_REINFORCE = 0, PPO_CISPO = 1, PPO_SAPO = 2 }; /* the kernels of the family */
#endif

typedef struct {
    ppo_vec zero, one, four, beta, half_beta;     /* reinforce: the KL penalty's */
    ppo_vec token_scale;
    ppo_vec low, high, clamp, negative_clamp;     /* cispo and sapo: low and high cispo's only */
    ppo_vec negative_tau_pos, negative_tau_neg;   /* sapo: -tau and 4 / tau by the advantage's */
    ppo_vec gate_pos, gate_neg;                   /* sign, tau_pos where it is > 0 */
    ppo_f64x8 scale;
    ppo_clipped_exp clipped_exp;                  /* cispo and sapo: the ratios' */
    int penalised;
} PPO_ROW(ppo_family_params);

typedef struct {
    ppo_f64x8 loss, kl;
    ppo_count clipped, lower;
} PPO_ROW(ppo_family_sums);

/* SAPO's sigmoid(tau * (ratio - 1)) = 1 / (1 + exp(-(tau * (ratio - 1)))), its -(tau * x) as
 * (-tau) * x: the same product, a sign flip being exact. */
PPO_INLINE ppo_vec PPO_ROW(ppo_sapo_exponent)(
    ppo_vec advantage, ppo_vec ratio, const PPO_ROW(ppo_family_params) * p) {
    ppo_vec negative_tau = PPO_V(select)(
        PPO_V(gt)(advantage, p->zero), p->negative_tau_pos, p->negative_tau_neg);
    return PPO_V(mul)(negative_tau, PPO_V(sub)(ratio, p->one));
}
PPO_INLINE ppo_vec PPO_ROW(ppo_sapo_sigmoid)(
    ppo_vec advantage, ppo_vec ratio, const PPO_ROW(ppo_family_params) * p) {
    ppo_vec e = PPO_V(exp)(PPO_ROW(ppo_sapo_exponent)(advantage, ratio, p));
    return PPO_V(div)(p->one, PPO_V(add)(p->one, e));
}
/* The sigmoids of the 16 tokens from position i (ratios from `at`), two blocks at once, as the
 * ratios (lanes.h ppo_f32x8_clipped_exp16). */
PPO_INLINE void PPO_ROW(ppo_sapo_sigmoids_pair)(
    const ppo_real* advantages, ptrdiff_t i, const ppo_real* ratios, ptrdiff_t at,
    const PPO_ROW(ppo_family_params) * p, ppo_real* sigmoids) {
    ppo_vec first = PPO_ROW(ppo_sapo_exponent)(
        PPO_V(load)(advantages + i), PPO_V(load)(ratios + at), p);
    ppo_vec second = PPO_ROW(ppo_sapo_exponent)(
        PPO_V(load)(advantages + i + 8), PPO_V(load)(ratios + at + 8), p);
    ppo_vec first_exp, second_exp;
    PPO_V(exp_pair)(first, second, &first_exp, &second_exp);
    PPO_V(store)(sigmoids + at, PPO_V(div)(p->one, PPO_V(add)(p->one, first_exp)));
    PPO_V(store)(sigmoids + at + 8, PPO_V(div)(p->one, PPO_V(add)(p->one, second_exp)));
}

/* The twin's loop body for the 8 tokens from position i, their ratios and sigmoids given (for the
 * kernels that have them). */
PPO_INLINE void PPO_ROW(ppo_family_block)(
    int kind, int has_mask, int has_weights, const ppo_real* logprobs, const ppo_real* old_logprobs,
    const ppo_real* advantages, const ppo_real* weights, const uint8_t* mask, ptrdiff_t i,
    ppo_vec ratio, ppo_vec sigmoid, const PPO_ROW(ppo_family_params) * p, ppo_real* grad,
    PPO_ROW(ppo_family_sums) * sums) {
    ppo_mask valid = has_mask ? PPO_M(from_bytes)(mask + i) : PPO_M(all)();
    ppo_vec logprob = PPO_V(load)(logprobs + i), advantage = PPO_V(load)(advantages + i);
    ppo_vec raw_log_ratio = PPO_V(sub)(logprob, PPO_V(load)(old_logprobs + i));
    ppo_vec log_ratio, slope, objective;
    if (kind == PPO_REINFORCE) {
        log_ratio = raw_log_ratio;
        objective = PPO_V(mul)(advantage, logprob);
        slope = advantage;
        if (p->penalised) {
            objective = PPO_V(sub)(
                objective, PPO_V(mul)(p->half_beta, PPO_V(mul)(log_ratio, log_ratio)));
            slope = PPO_V(sub)(advantage, PPO_V(mul)(p->beta, log_ratio));
        }
    } else if (kind == PPO_CISPO) {
        log_ratio = PPO_ROW(ppo_clip)(raw_log_ratio, p->negative_clamp, p->clamp);
        ppo_vec coefficient = PPO_ROW(ppo_clip)(ratio, p->low, p->high);
        slope = PPO_V(mul)(coefficient, advantage);
        objective = PPO_V(mul)(slope, logprob);
        /* coefficient != ratio: NaN ratios too */
        ppo_mask is_clipped = PPO_M(and_not)(valid, PPO_V(eq)(coefficient, ratio));
        sums->clipped = PPO_C(add)(sums->clipped, is_clipped);
        sums->lower = PPO_C(add)(sums->lower, PPO_M(and)(valid, PPO_V(lt)(ratio, p->low)));
    } else {
        /* torch.clamp passes the gradient at its bounds, and a NaN log-ratio's NaN: the twin's
         * !((raw < -clamp) || (raw > clamp)) */
        ppo_mask inside = PPO_M(and_not)(
            PPO_M(and_not)(PPO_M(all)(), PPO_V(lt)(raw_log_ratio, p->negative_clamp)),
            PPO_V(gt)(raw_log_ratio, p->clamp));
        log_ratio = PPO_ROW(ppo_clip)(raw_log_ratio, p->negative_clamp, p->clamp);
        ppo_vec gate = PPO_V(mul)(
            sigmoid, PPO_V(select)(PPO_V(gt)(advantage, p->zero), p->gate_pos, p->gate_neg));
        ppo_vec gradient_gate =
            PPO_V(mul)(PPO_V(mul)(p->four, sigmoid), PPO_V(sub)(p->one, sigmoid));
        slope = PPO_V(select)(inside, PPO_V(mul)(PPO_V(mul)(advantage, gradient_gate), ratio),
                              p->zero);
        objective = PPO_V(mul)(gate, advantage);
    }
    sums->loss = PPO_ROW(ppo_policy_gradient)(
        has_weights, weights, i, valid, slope, objective, p->zero, p->token_scale, p->scale, grad,
        sums->loss);
    sums->kl = ppo_f64x8_sub(sums->kl, PPO_V(to_f64_where)(valid, log_ratio));
}

/* The row's valid prefix, a chunk at a time: the chunk's exps first (prefetching the next chunk's
 * inputs meanwhile, past the row's end the next row's: ppo_ahead), then the rest, as
 * ppo_clipped_surrogate_cases (rows_loss.h). REINFORCE has no exp, and goes through its chunks in
 * one pass, prefetching in it (without: 1.4 times the time on float32 (1024, 4096) rows with
 * lengths in [T/2, T]). Positions past the length get a zero gradient and nothing else, which is
 * what the twin computes for them. */
PPO_INLINE void PPO_ROW(ppo_family_cases)(
    int kind, int has_mask, int has_weights, const ppo_real* logprobs, const ppo_real* old_logprobs,
    const ppo_real* advantages, const ppo_real* weights, ptrdiff_t start, ptrdiff_t span,
    ptrdiff_t length, const uint8_t* mask, const PPO_ROW(ppo_family_params) * p, ppo_real* grad,
    double* row_loss, double* row_clipped, double* row_lower, double* row_kl) {
    ppo_real ratios[PPO_CHUNK], sigmoids[PPO_CHUNK];
    ppo_f64x8 loss = ppo_f64x8_splat(0.0), kl = ppo_f64x8_splat(0.0);
    int64_t clipped = 0, lower = 0;
    ptrdiff_t valid_end = ppo_valid_stop(start, span, length);
    if (has_mask) valid_end = ppo_mask_stop(mask, start, valid_end); /* as rows_loss.h's */
    for (ptrdiff_t first = start; first < valid_end; first += PPO_CHUNK) {
        ptrdiff_t end = valid_end - first < PPO_CHUNK ? valid_end : first + PPO_CHUNK;
        ptrdiff_t whole_end = end - (end - first) % 8, i;
        PPO_ROW(ppo_family_sums) sums = {loss, kl, PPO_C(zero)(), PPO_C(zero)()};
        if (kind != PPO_REINFORCE) {
            PPO_ROW(ppo_chunk_ratios)(
                logprobs, old_logprobs, advantages, has_weights ? weights : NULL,
                has_mask ? mask : NULL, first, whole_end, valid_end, start + span,
                &p->clipped_exp, p->negative_clamp, p->clamp, ratios);
        }
        /* the sigmoids' exps in a pass of their own: each a short chain, as the ratios' */
        for (i = first; kind == PPO_SAPO && i + 16 <= whole_end; i += 16) {
            PPO_ROW(ppo_sapo_sigmoids_pair)(advantages, i, ratios, i - first, p, sigmoids);
        }
        for (; kind == PPO_SAPO && i < whole_end; i += 8) {
            ppo_vec ratio = PPO_V(load)(ratios + (i - first));
            ppo_vec sigmoid = PPO_ROW(ppo_sapo_sigmoid)(PPO_V(load)(advantages + i), ratio, p);
            PPO_V(store)(sigmoids + (i - first), sigmoid);
        }
        for (i = first; i < whole_end; i += 8) {
            ppo_vec ratio = p->zero, sigmoid = p->zero;
            if (kind == PPO_REINFORCE) { /* no pre-pass: its prefetches come here */
                PPO_ROW(ppo_prefetch_ahead)(
                    logprobs, old_logprobs, advantages, has_weights ? weights : NULL,
                    has_mask ? mask : NULL, first, i, ppo_ahead(i, valid_end, start + span));
            }
            if (kind != PPO_REINFORCE) ratio = PPO_V(load)(ratios + (i - first));
            if (kind == PPO_SAPO) sigmoid = PPO_V(load)(sigmoids + (i - first));
            PPO_ROW(ppo_family_block)(
                kind, has_mask, has_weights, logprobs, old_logprobs, advantages, weights, mask, i,
                ratio, sigmoid, p, grad, &sums);
        }
        if (i < end) {
            const ppo_real* const arrays[PPO_TAIL_ARRAYS] = {
                logprobs, old_logprobs, advantages, has_weights ? weights : NULL};
            PPO_ROW(ppo_tail) tail;
            PPO_ROW(ppo_tail_fill)(&tail, arrays, has_mask, mask, i, end - i);
            ppo_vec ratio = p->zero, sigmoid = p->zero;
            if (kind != PPO_REINFORCE)
                ratio = PPO_ROW(ppo_clipped_ratio)(
                    tail.tokens[0], tail.tokens[1], 0, p->negative_clamp, p->clamp);
            if (kind == PPO_SAPO)
                sigmoid = PPO_ROW(ppo_sapo_sigmoid)(PPO_V(load)(tail.tokens[2]), ratio, p);
            PPO_ROW(ppo_family_block)(
                kind, 1, has_weights, tail.tokens[0], tail.tokens[1], tail.tokens[2],
                tail.tokens[3], tail.mask, 0, ratio, sigmoid, p, tail.grad, &sums);
            memcpy(grad + i, tail.grad, (size_t)(end - i) * sizeof(ppo_real));
        }
        loss = sums.loss;
        kl = sums.kl;
        clipped += PPO_C(total)(sums.clipped);
        lower += PPO_C(total)(sums.lower);
    }
    for (ptrdiff_t i = valid_end; i < start + span; i++) grad[i] = 0;
    *row_loss = ppo_f64x8_total(loss);
    *row_clipped = (double)clipped;
    *row_lower = (double)lower;
    *row_kl = ppo_f64x8_total(kl);
}

/* One specialization per case: without a mask or weights, nothing is loaded for them. */
#define PPO_FAMILY_CASES(kind)                                                                 \
    do {                                                                                       \
        if (has_mask && has_weights)                                                           \
            PPO_FAMILY_CASE(kind, 1, 1);                                                       \
        else if (has_mask)                                                                     \
            PPO_FAMILY_CASE(kind, 1, 0);                                                       \
        else if (has_weights)                                                                  \
            PPO_FAMILY_CASE(kind, 0, 1);                                                       \
        else                                                                                   \
            PPO_FAMILY_CASE(kind, 0, 0);                                                       \
    } while (0)
#define PPO_FAMILY_CASE(kind, mask_case, weights_case)                                         \
    PPO_ROW(ppo_family_cases)(                                                                 \
        kind, mask_case, weights_case, logprobs, old_logprobs, advantages, weights, start, span, \
        length, mask, &p, grad, row_loss, &row_clipped, &row_lower, row_kl)

/* The parameters every kernel shares: 0 in the dtype as the twin (the scale is finite). */
PPO_INLINE void PPO_ROW(ppo_family_init)(PPO_ROW(ppo_family_params) * p, ppo_real scale) {
    ppo_real zero = scale - scale, one = 1;
    memset(p, 0, sizeof *p);
    p->zero = PPO_V(splat)(zero);
    p->one = PPO_V(splat)(one);
    p->four = PPO_V(splat)(one + one + one + one);
    p->scale = ppo_f64x8_splat((double)scale);
    p->token_scale = PPO_V(splat)(scale);
}

/* -- REINFORCE / GPG / DRO --------------------------------------------------------------------- */

static void PPO_ROW(ppo_reinforce_row)(
    const ppo_real* logprobs, const ppo_real* old_logprobs, const ppo_real* advantages,
    const ppo_real* weights, int has_weights, ptrdiff_t start, ptrdiff_t span, ptrdiff_t length,
    const uint8_t* mask, int has_mask, ppo_real scale, ppo_real beta, ppo_real* grad,
    double* row_loss, double* row_kl) {
    PPO_ROW(ppo_family_params) p;
    double row_clipped, row_lower;
    PPO_ROW(ppo_family_init)(&p, scale);
    p.beta = PPO_V(splat)(beta);
    p.half_beta = PPO_V(splat)(beta * (ppo_real)0.5);
    p.penalised = beta != 0;
    PPO_FAMILY_CASES(PPO_REINFORCE);
}

/* -- CISPO ------------------------------------------------------------------------------------- */

static void PPO_ROW(ppo_cispo_row)(
    const ppo_real* logprobs, const ppo_real* old_logprobs, const ppo_real* advantages,
    const ppo_real* weights, int has_weights, ptrdiff_t start, ptrdiff_t span, ptrdiff_t length,
    const uint8_t* mask, int has_mask, ppo_real scale, ppo_real ratio_low, ppo_real ratio_high,
    ppo_real log_ratio_clamp, ppo_real* grad, double* row_loss, double* row_clipped_out,
    double* row_lower_out, double* row_kl) {
    PPO_ROW(ppo_family_params) p;
    double row_clipped, row_lower;
    PPO_ROW(ppo_family_init)(&p, scale);
    p.low = PPO_V(splat)(ratio_low);
    p.high = PPO_V(splat)(ratio_high);
    p.clamp = PPO_V(splat)(log_ratio_clamp);
    p.negative_clamp = PPO_V(splat)(-log_ratio_clamp);
    p.clipped_exp = ppo_clipped_exp_of(log_ratio_clamp);
    PPO_FAMILY_CASES(PPO_CISPO);
    *row_clipped_out = row_clipped;
    *row_lower_out = row_lower;
}

/* -- SAPO -------------------------------------------------------------------------------------- */

static void PPO_ROW(ppo_sapo_row)(
    const ppo_real* logprobs, const ppo_real* old_logprobs, const ppo_real* advantages,
    const ppo_real* weights, int has_weights, ptrdiff_t start, ptrdiff_t span, ptrdiff_t length,
    const uint8_t* mask, int has_mask, ppo_real scale, ppo_real tau_pos, ppo_real tau_neg,
    ppo_real log_ratio_clamp, ppo_real* grad, double* row_loss, double* row_kl) {
    PPO_ROW(ppo_family_params) p;
    double row_clipped, row_lower;
    ppo_real one = 1, four = one + one + one + one;
    PPO_ROW(ppo_family_init)(&p, scale);
    p.clamp = PPO_V(splat)(log_ratio_clamp);
    p.negative_clamp = PPO_V(splat)(-log_ratio_clamp);
    p.clipped_exp = ppo_clipped_exp_of(log_ratio_clamp);
    p.negative_tau_pos = PPO_V(splat)(-tau_pos);
    p.negative_tau_neg = PPO_V(splat)(-tau_neg);
    p.gate_pos = PPO_V(splat)(four / tau_pos); /* 4 / tau in the dtype, divided once */
    p.gate_neg = PPO_V(splat)(four / tau_neg);
    PPO_FAMILY_CASES(PPO_SAPO);
}

#undef PPO_FAMILY_CASES
#undef PPO_FAMILY_CASE
