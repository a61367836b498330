#!/usr/bin/env bash
# Device check of the Pallas kernels (fused log-prob/entropy, flash attention) on one GPU (written for an H200).
#
#   OUT=/path/to/results bash scripts/device_check.sh      # on the GPU machine, repo root
#   SMOKE=1 PYTHON=.venv/bin/python OUT=/tmp/dc bash scripts/device_check.sh   # any machine: tiny
#                                                          shapes, interpreted kernels
#
# Installs nothing. Needs python3 with a CUDA jax (0.11 or newer). Stages, each saved to
# $OUT/device_check.json as soon as it ends, so a timeout keeps what finished:
#   1. correctness: the pallas backend compiled for the GPU ("gpu" layout, Triton) against xla, float32,
#      bfloat16 and bfloat16 hidden with a float32 weight, ragged T and V, values and gradients;
#   2. speed at T = 8192, D = 4096, V = 248,320 (bf16): a plain [T, D] x [D, V] matmul, then pallas and
#      xla forward+backward, as rates of 8 T D V FLOPs (forward 2, backward recompute 2 + dh 2 + dW 2),
#      with compile-time scratch memory;
#   3. attention (kernels/qwen35_kernels/attention/pallas_gpu.py): the Pallas Triton flash kernel with document
#      masks and cuDNN's (attention/cudnn.py; with max_segments=2 too, which sends the row to its
#      Triton fallback) against the XLA core at S = 4096, 8 query / 2 kv heads, Dh = 256, bf16 (errors
#      against a float32 reference, forward and forward+backward time, scratch memory, a few block sizes);
#   4. a sweep of Triton block sizes of the log-prob kernel, while time is left;
#   5. (scripts/bench/bench_train.py, each call limited to TRAIN_LIMIT_S) the train step of the 0.8B shapes,
#      all 24 layers, bfloat16 compute, one row of 8192 tokens: tokens/s and MFU against the H200's
#      989 TFLOP/s dense bf16 peak ($OUT/train_step.json) and one traced step
#      ($OUT/train_profile.xplane.pb.gz, for xprof) with its optimised HLO ($OUT/train_step_hlo.txt.gz).
#      If the step fails, it runs again with the XLA chunk scan, which keeps the GDN mixer's conv and
#      norms in XLA too ($OUT/train_step_associative.json) and,
#      failing that, also on XLA's attention and log-prob kernels ($OUT/train_step_xla.json), which
#      tells which Pallas kernel was the cause. Else the GDN core alone at S = 8192, 16 heads of 128,
#      forward+backward with the Pallas chunk scan at Precision.HIGHEST, DEFAULT and bf16 operands, three
#      kernel blocks each, and the chunk-local part's kernels against XLA at each precision
#      ($OUT/gdn_core.json; GDN_CORE=0 skips it), then four rows of 8192 ($OUT/train_step_b4.json;
#      TRAIN_B4=0 skips it). Before those it times more one-row steps, one per line of
#      scripts/bench/device_check_variants.txt ($OUT/train_variant_<n>.json, n counting from 1 in the
#      list), each a set of bench_train flags optionally led by NAME=VALUE environment words
#      (XLA_FLAGS=--flag adds to XLA_FLAGS). TRAIN_VARIANT_RANGE=6-9 (or 6, or 6-) runs only those;
#      TRAIN_VARIANTS="--attention xla;--scan-layers true" replaces the list (';'-separated, empty:
#      none). LIST_VARIANTS=1 prints the variants it would run, numbered, with their bench_train
#      arguments, and exits.
#   6. (scripts/bench/bench_generate.py, limited to GENERATE_LIMIT_S) generation of the 0.8B shapes,
#      bfloat16, random weights, greedy: 64 rows x 128-token prompts + 128 new tokens (decode tokens/s)
#      and one 8,192-token prompt + 1 token (prefill tokens/s), with each case's cache bytes
#      ($OUT/generate.json, log $OUT/generate_log.txt).
# KERNEL_STAGES=correctness,attention (names as in device_check.json) runs only those of 1-4.
# STAGES=kernels (1-4), STAGES=train (5) or STAGES=generate (6) runs one part (default: all three). The
# first train call (compile, 4 steps, the traced step and its HLO dump) is the longest, most of it the
# compile of the 0.8B step with the blocks one after another: keep TRAIN_LIMIT_S at 150 or more
# (docs/lab_log.md has the H200's times). Run the two parts as two commands where
# a command is limited to 10 minutes, train first.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-./device_check_out}"

if [ "${SMOKE:-0}" = "1" ]; then  # the train stage's shapes: tiny in smoke mode, any backend
  shape=(--preset tiny --seq 128 --core-seq 128 --core-heads 2 --core-dim 16)
  core_blocks=(64:4)  # one kernel block: each is a compile of the interpreted kernel, the flag is what is checked
else
  shape=(--preset 0.8B --seq 8192 --core-seq 8192 --core-heads 16 --core-dim 128)
  core_blocks=(64:4 32:4 16:4)
fi
bench=(scripts/bench/bench_train.py "${shape[@]}" --dtype bfloat16 --steps 3 --skip-torch --peak-tflops 989)

# The train stage's variants: the lines of scripts/bench/device_check_variants.txt, or TRAIN_VARIANTS
# split at ';'; comments ('#' to the end of the line) and blank entries dropped, numbered from 1,
# TRAIN_VARIANT_RANGE=FIRST[-[LAST]] keeping some. variant_num[i] is the number, variant_words[i] the words.
variant_num=() variant_words=()
select_variants() {
  local entries=() entry words n=0 first=1 last=0
  if [ -n "${TRAIN_VARIANTS+set}" ]; then
    IFS=';' read -ra entries <<<"$TRAIN_VARIANTS"
  else
    mapfile -t entries <scripts/bench/device_check_variants.txt || return 1
  fi
  if [ -n "${TRAIN_VARIANT_RANGE:-}" ]; then
    if [[ "$TRAIN_VARIANT_RANGE" =~ ^([1-9][0-9]*)(-([1-9][0-9]*)?)?$ ]]; then
      first=${BASH_REMATCH[1]}
      if [ -z "${BASH_REMATCH[2]}" ]; then last=$first; else last=${BASH_REMATCH[3]:-0}; fi
    else
      echo "TRAIN_VARIANT_RANGE=$TRAIN_VARIANT_RANGE: expected FIRST, FIRST-LAST or FIRST- (counting from 1)" >&2
      return 1
    fi
  fi
  for entry in "${entries[@]}"; do
    [[ "$entry" =~ ^[[:space:]]*# ]] && continue
    entry="${entry%%[[:space:]]#*}"
    read -ra words <<<"$entry"
    [ ${#words[@]} -eq 0 ] && continue
    n=$((n + 1))
    if [ "$n" -ge "$first" ] && { [ "$last" -eq 0 ] || [ "$n" -le "$last" ]; }; then
      variant_num+=("$n") variant_words+=("${words[*]}")
    fi
  done
  if [ -n "${TRAIN_VARIANT_RANGE:-}" ] && [ "$n" -gt 0 ] && [ ${#variant_num[@]} -eq 0 ]; then
    echo "TRAIN_VARIANT_RANGE=$TRAIN_VARIANT_RANGE selects none of the $n variants" >&2
    return 1
  fi
}
# a variant's leading NAME=VALUE words (envs) and its bench_train flags (flags)
split_variant() {
  local w words
  read -ra words <<<"$1"
  envs=() flags=()
  for w in "${words[@]}"; do
    if [ ${#flags[@]} -eq 0 ] && [[ "$w" =~ ^[A-Z_][A-Z0-9_]*= ]]; then envs+=("$w"); else flags+=("$w"); fi
  done
}
select_variants || exit 2
if [ "${LIST_VARIANTS:-0}" = "1" ]; then  # number, the variant, then the bench_train arguments it runs with
  for i in "${!variant_num[@]}"; do
    split_variant "${variant_words[$i]}"
    printf '%s\t%s\t%s\n' "${variant_num[$i]}" "${variant_words[$i]}" \
      "${bench[*]:1} --batch 1 ${flags[*]} --json $OUT/train_variant_${variant_num[$i]}.json"
  done
  exit 0
fi
mkdir -p "$OUT"
export PYTHONPATH=".:kernels${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv || true; } >"$OUT/nvidia_smi.txt" 2>&1

STAGES="${STAGES:-kernels,train,generate}"
status=0
if [[ ",$STAGES," == *,kernels,* ]]; then
timeout "${LIMIT_S:-460}" "${PYTHON:-python3}" - "$OUT" <<'PY' 2>&1 | tee "$OUT/log.txt"
import json, os, sys, time, traceback

import jax
import jax.numpy as jnp
import numpy as np

from qwen35_kernels.logprob_entropy import api, pallas, xla

OUT = sys.argv[1]
SMOKE = os.environ.get("SMOKE") == "1"
START = time.perf_counter()
BUDGET_S = float(os.environ.get("SWEEP_UNTIL_S", "330"))  # no new sweep entry after this
results = {"jax": jax.__version__, "devices": [str(d) for d in jax.devices()], "smoke": SMOKE,
           "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime())}


def save():
    with open(os.path.join(OUT, "device_check.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)


ONLY = [s for s in os.environ.get("KERNEL_STAGES", "").split(",") if s]  # empty: every stage


def stage(name):
    def wrap(fn):
        if ONLY and name not in ONLY:
            return
        t0 = time.perf_counter()
        try:
            results[name] = fn()
        except Exception as e:  # keep going: later stages still tell something
            results[name] = {"error": f"{type(e).__name__}: {e}"[:3000]}
            traceback.print_exc()
        print(f"== {name} ({time.perf_counter() - t0:.1f} s): {json.dumps(results[name], default=str)[:1500]}")
        save()
    return wrap


def blocks(**kw):
    return pallas.make_blocks("gpu", interpret=SMOKE, **kw)


def problem(T, D, V, dtype, seed=0):
    k = jax.random.split(jax.random.key(seed), 5)
    h = jax.random.normal(k[0], (T, D), jnp.float32).astype(dtype)
    w = (jax.random.normal(k[1], (D, V), jnp.float32) * D**-0.5).astype(dtype)
    labels = jax.random.randint(k[2], (T,), 0, V)
    labels = jnp.where(jax.random.uniform(k[3], (T,)) < 0.1, -1, labels)
    g = jax.random.normal(k[4], (2, T))
    return h, w, labels, g


def step(stats_fn, labels, g):
    def objective(h, w):
        lse, ent, zl = stats_fn(h, w, labels)
        lp = api.log_probs_from_stats(lse, zl, labels)
        return jnp.sum(g[0] * lp) + jnp.sum(g[1] * ent), (lp, ent)
    return jax.jit(jax.value_and_grad(objective, (0, 1), has_aux=True))


def timeit(f, *args, n=5):
    jax.block_until_ready(f(*args))
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


@stage("correctness")
def _():
    out = {}
    T, D, V = (37, 64, 203) if SMOKE else (1000, 512, 5003)
    for name, dtype, w_dtype, tol_val, tol_grad in (
            ("float32", jnp.float32, jnp.float32, 1e-4, 1e-3), ("bfloat16", jnp.bfloat16, jnp.bfloat16, 2e-3, 3e-2),
            ("bfloat16_hidden_float32_weight", jnp.bfloat16, jnp.float32, 1e-4, 1e-3)):  # mixed: promoted to f32
        h, w, labels, g = problem(T, D, V, dtype)
        w = w.astype(w_dtype)
        with jax.default_matmul_precision("highest"):
            (_, (lp0, e0)), (dh0, dw0) = step(lambda h, w, l: xla.token_stats(h, w, l), labels, g)(h, w)
            (_, (lp1, e1)), (dh1, dw1) = step(
                lambda h, w, l: pallas.token_stats(h, w, l, blocks=blocks()), labels, g)(h, w)
        r = {"lp_abs": float(jnp.max(jnp.abs(lp1 - lp0))), "ent_abs": float(jnp.max(jnp.abs(e1 - e0))),
             "dh_rel": rel(dh1, dh0), "dw_rel": rel(dw1, dw0)}
        r["ok"] = bool(r["lp_abs"] < tol_val and r["ent_abs"] < tol_val and r["dh_rel"] < tol_grad
                       and r["dw_rel"] < tol_grad)
        out[name] = r
    return out


T, D, V = (128, 64, 1000) if SMOKE else (8192, 4096, 248320)
FLOPS = 8.0 * T * D * V
h, w, labels, g = problem(T, D, V, jnp.bfloat16)


@stage("matmul")
def _():
    f = jax.jit(lambda h, w: jnp.dot(h, w))  # [T, V] bf16, 2 T D V FLOPs
    t = timeit(f, h, w)
    return {"T": T, "D": D, "V": V, "time_s": t, "tflops": 2.0 * T * D * V / t / 1e12}


def fused(name, stats_fn, with_memory=True):
    f = step(stats_fn, labels, g)
    r = {}
    if with_memory:
        r["scratch_MiB"] = f.lower(h, w).compile().memory_analysis().temp_size_in_bytes / 2**20
    r["time_s"] = timeit(f, h, w, n=3)
    r["tflops"] = FLOPS / r["time_s"] / 1e12
    mm = results.get("matmul", {}).get("tflops")
    if mm:
        r["fraction_of_matmul"] = r["tflops"] / mm
    return r


@stage("pallas_forward")
def _():
    f = jax.jit(lambda h, w: pallas.token_stats(h, w, labels, blocks=blocks()))
    t = timeit(f, h, w)
    return {"time_s": t, "tflops": 2.0 * T * D * V / t / 1e12}


@stage("pallas_fwd_bwd")
def _():
    return fused("pallas", lambda h, w, l: pallas.token_stats(h, w, l, blocks=blocks()))


@stage("xla_fwd_bwd")
def _():
    return fused("xla", lambda h, w, l: xla.token_stats(h, w, l))


@stage("attention")
def _():
    # Flash attention with document masks (kernels/qwen35_kernels/attention/pallas_gpu.py, Pallas Triton)
    # against the XLA core, bf16, packed documents, GQA. qwen35_kernels imports only jax.
    from qwen35_kernels.attention import pallas_gpu as ak

    try:
        from qwen35_kernels.attention import attention_core
        xla_core, xla_name = (lambda q, k, v, s: attention_core(q, k, v, s, implementation="xla")), "attention_core"
    except ImportError as e:  # a plain float32 masked softmax (the same semantics)
        xla_name = f"inline reference ({e})"

        def xla_core(q, k, v, s):
            g = q.shape[2] // k.shape[2]
            k, v = jnp.repeat(k, g, 2), jnp.repeat(v, g, 2)
            logits = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) * q.shape[-1] ** -0.5
            n = q.shape[1]
            mask = (jnp.arange(n)[:, None] >= jnp.arange(n)[None, :]) & (s[:, :, None] == s[:, None, :])[:, None]
            p = jax.nn.softmax(jnp.where(mask, logits, jnp.finfo(jnp.float32).min), axis=-1).astype(v.dtype)
            return jnp.einsum("bhqk,bkhd->bqhd", p, v)

    B, S, H, K, Dh = (1, 300, 4, 2, 64) if SMOKE else (1, 4096, 8, 2, 256)  # 0.8B attention shapes
    key = jax.random.split(jax.random.key(1), 4)
    q32, k32, v32 = (jax.random.normal(kk, (B, S, n, Dh), jnp.float32) for kk, n in zip(key, (H, K, K)))
    cut = np.sort(np.random.default_rng(0).integers(1, S, size=3))
    seg = jnp.asarray((1 + (np.arange(S) >= cut[0]) + (np.arange(S) >= cut[1])) * (np.arange(S) < cut[2]),
                      jnp.int32)[None].repeat(B, 0)  # 3 documents, padding (0) after cut[2]
    gout = jax.random.normal(key[3], (B, S, H, Dh), jnp.float32)
    q, k, v = (x.astype(jnp.bfloat16) for x in (q32, k32, v32))
    out = {"S": S, "H": H, "K": K, "Dh": Dh, "xla_impl": xla_name, "segment_cuts": cut.tolist()}

    def step(fn):
        def loss(q, k, v):
            o = fn(q, k, v, seg)
            return jnp.sum(o.astype(jnp.float32) * gout), o
        return jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))

    with jax.default_matmul_precision("highest"):  # float32 reference from the same bf16 inputs
        (_, want), want_g = step(xla_core)(*(x.astype(jnp.float32) for x in (q, k, v)))
    fns = {"pallas": lambda q, k, v, s: ak.gpu_flash_attention(q, k, v, s), "xla": xla_core}
    try:  # cuDNN with the documents as packed segments (kernels/qwen35_kernels/attention/cudnn.py); bf16 only
        from qwen35_kernels.attention import cudnn as acu
        fns["cudnn"] = lambda q, k, v, s: acu.cudnn_flash_attention(q, k, v, s)
        # 2 segments at most: this row's 4 runs go to the Triton fallback through the same lax.cond
        fns["cudnn_fallback"] = lambda q, k, v, s: acu.cudnn_flash_attention(q, k, v, s, max_segments=2)
    except ImportError as e:
        out["cudnn"] = {"error": f"ImportError: {e}"[:300]}
    for name, fn in fns.items():
        try:
            f = step(fn)
            (_, o), grads = f(q, k, v)
            r = {"out_abs_err": float(jnp.max(jnp.abs(o.astype(jnp.float32) - want)))}
            for n_, g_, w_ in zip("qkv", grads, want_g):
                r[f"d{n_}_rel_err"] = rel(g_.astype(jnp.float32), w_)
            r["scratch_MiB"] = f.lower(q, k, v).compile().memory_analysis().temp_size_in_bytes / 2**20
            if name != "cudnn_fallback":  # its values are the point, its time is the Triton kernel's
                r["fwd_s"] = timeit(jax.jit(lambda q, k, v: fn(q, k, v, seg)), q, k, v)
                r["fwd_bwd_s"] = timeit(f, q, k, v, n=3)
        except Exception as e:
            if name in ("pallas", "xla"):
                raise
            r = {"error": f"{type(e).__name__}: {e}"[:500]}
        out[name] = r
        save()
    x = out["xla"]

    def close(r):  # the kernels keep scores in float32 (the XLA core rounds them to bf16 first): no worse than XLA
        return bool("error" not in r and r["out_abs_err"] <= max(2 * x["out_abs_err"], 2e-2)
                    and all(r[f"d{n_}_rel_err"] <= max(2 * x[f"d{n_}_rel_err"], 5e-2) for n_ in "qkv"))

    out["ok"] = close(out["pallas"])
    for name in ("cudnn", "cudnn_fallback"):
        if name in out and "error" not in out[name]:
            out[f"{name}_ok"] = close(out[name])
    sweep = []
    for bq, bk, bb in [] if SMOKE else [(128, 128, 32), (128, 64, 32), (64, 64, 64), (64, 32, 32)]:
        if time.perf_counter() - START > BUDGET_S:
            sweep.append({"stopped": "time budget"})
            break
        fn = lambda q, k, v, s, bq=bq, bk=bk, bb=bb: ak.gpu_flash_attention(q, k, v, s, block_q=bq, block_k=bk,
                                                                             block_bwd=bb)
        try:
            sweep.append({"blocks": [bq, bk, bb], "fwd_bwd_s": timeit(step(fn), q, k, v, n=3)})
        except Exception as e:
            sweep.append({"blocks": [bq, bk, bb], "error": f"{type(e).__name__}: {e}"[:300]})
        out["block_sweep"] = sweep
        save()
    return out


@stage("sweep")
def _():
    configs = [  # (block_t, block_v, block_d, num_warps, num_stages)
        (64, 128, 64, 4, 2), (128, 128, 64, 8, 2), (64, 256, 64, 8, 2), (128, 256, 64, 8, 3),
        (64, 128, 32, 4, 3), (128, 128, 32, 4, 3), (32, 128, 64, 4, 2),
    ]
    out = []
    for bt, bv, bd, nw, ns in configs[:1] if SMOKE else configs:
        if time.perf_counter() - START > BUDGET_S:
            out.append({"stopped": "time budget"})
            break
        blk = blocks(block_t=bt, block_v=bv, block_d=bd, num_warps=nw, num_stages=ns)
        try:
            r = fused("pallas", lambda h, w, l: pallas.token_stats(h, w, l, blocks=blk), with_memory=False)
        except Exception as e:
            r = {"error": f"{type(e).__name__}: {e}"[:500]}
        out.append({"blocks": [bt, bv, bd, nw, ns], **r})
        print(out[-1])
        save()
    return out


print(f"total {time.perf_counter() - START:.1f} s")
PY
status=${PIPESTATUS[0]}
fi

if [[ ",$STAGES," == *,train,* ]]; then
  train() {  # bench_train with the stage's shapes and any further flags; log appended, with its wall time
    local start=$SECONDS rc
    timeout "${TRAIN_LIMIT_S:-330}" "${PYTHON:-python3}" "${bench[@]}" "$@" 2>&1 | tee -a "$OUT/train_step_log.txt"
    rc=${PIPESTATUS[0]}
    echo "== took $((SECONDS - start)) s, exit $rc: bench_train $*" | tee -a "$OUT/train_step_log.txt"
    return "$rc"
  }
  : >"$OUT/train_step_log.txt"
  # the step's optimised HLO names the fusions the trace shows (CUDA graphs hide them from xprof's
  # op statistics): dumped while it compiles, kept compressed
  XLA_FLAGS="${XLA_FLAGS:-} --xla_dump_to=$OUT/hlo --xla_dump_hlo_as_text --xla_dump_hlo_module_re=jit_step" \
    train --batch 1 --profile "$OUT/profile" --json "$OUT/train_step.json"
  train_status=$?
  # the traced step (xprof's .xplane.pb), compressed, two folders down at most so it comes back
  trace=$(find "$OUT/profile" -name '*.xplane.pb' 2>/dev/null | head -1)
  [ -n "$trace" ] && gzip -c "$trace" >"$OUT/train_profile.xplane.pb.gz"
  hlo=$(ls -S "$OUT"/hlo/*jit_step*after_optimizations.txt 2>/dev/null | head -1)
  [ -n "$hlo" ] && gzip -c "$hlo" >"$OUT/train_step_hlo.txt.gz"
  rm -rf "$OUT/profile" "$OUT/hlo"
  if [ "$train_status" -eq 124 ]; then  # out of time, not failed: a fallback would only spend more
    echo "== train step ran past TRAIN_LIMIT_S=${TRAIN_LIMIT_S:-330} s (compile, steps and trace); no fallback" \
      | tee -a "$OUT/train_step_log.txt"
  elif [ "$train_status" -ne 0 ]; then  # which kernel? the same step with the XLA chunk scan, then XLA's kernels
    echo "== train step failed ($train_status); again with --gdn-chunk-scan associative" | tee -a "$OUT/train_step_log.txt"
    train --batch 1 --gdn-chunk-scan associative --json "$OUT/train_step_associative.json" || {
      echo "== failed again; with --attention xla --logprob-backend xla" | tee -a "$OUT/train_step_log.txt"
      train --batch 1 --gdn-chunk-scan associative --attention xla --logprob-backend xla \
        --json "$OUT/train_step_xla.json"; }
  else
    # more one-row steps, each with its own bench_train flags (the variants selected above); leading
    # NAME=VALUE words set environment variables for that call (XLA_FLAGS=... adds to XLA_FLAGS)
    for i in "${!variant_num[@]}"; do
      split_variant "${variant_words[$i]}"
      echo "== variant ${variant_num[$i]}: ${variant_words[$i]}" | tee -a "$OUT/train_step_log.txt"
      (
        for e in "${envs[@]}"; do
          if [[ "$e" == XLA_FLAGS=* ]]; then export XLA_FLAGS="${XLA_FLAGS:-} ${e#XLA_FLAGS=}"; else export "$e"; fi
        done
        train --batch 1 "${flags[@]}" --json "$OUT/train_variant_${variant_num[$i]}.json"
      )
    done
    # HIGHEST (IEEE float32) against DEFAULT (TF32) and bf16 operands, each at three (state columns per
    # program, warps) of the chunk-state kernel; errors against the first (HIGHEST, the default blocks);
    # then the chunk-local part alone, its Pallas kernels against the XLA ops, at each precision
    [ "${GDN_CORE:-1}" = "1" ] && train --batch 1 --cores gdn gdn_local --cores-only --core-precisions highest default bf16 \
      --core-scans pallas --core-kernel-blocks "${core_blocks[@]}" --json "$OUT/gdn_core.json"
    # four rows of 8192: what a larger step buys (fixed costs, occupancy)
    [ "${SMOKE:-0}" != "1" ] && [ "${TRAIN_B4:-1}" = "1" ] && train --batch 4 --json "$OUT/train_step_b4.json"
  fi
  [ "$status" -eq 0 ] && status=$train_status
fi
if [[ ",$STAGES," == *,generate,* ]]; then
  if [ "${SMOKE:-0}" = "1" ]; then
    generate=(--preset tiny --case decode:2:8:4 --case prefill:1:64:1 --steps 1)
  else
    generate=(--preset 0.8B --case decode:64:128:128 --case prefill:1:8192:1 --steps 3)
  fi
  start=$SECONDS
  timeout "${GENERATE_LIMIT_S:-300}" "${PYTHON:-python3}" scripts/bench/bench_generate.py "${generate[@]}" \
    --dtype bfloat16 --skip-torch --json "$OUT/generate.json" 2>&1 | tee "$OUT/generate_log.txt"
  generate_status=${PIPESTATUS[0]}
  echo "== took $((SECONDS - start)) s, exit $generate_status: bench_generate" | tee -a "$OUT/generate_log.txt"
  [ "$status" -eq 0 ] && status=$generate_status
fi
echo "exit status $status; results in $OUT"
exit $status
