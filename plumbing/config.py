"""What a run does, on one page: every flag with its paper symbol, default and range; the named presets; the rules
that set one flag from another. Every field below is a flag of train.py (`--field-name`); `python train.py --help`
lists the ones a first reading needs, `--help-all` every one.

A run's configuration is built in layers, each only for the flags NOT given on the command line (a flag given always
wins), in this order:
  1. the fields' defaults below: PPO-max (§5.4) at the synthetic world's scale, at the operating point registry v2
     chose by what it achieves (η 0.2, ptx on the demonstrations at 0.25: docs/findings.md);
  2. --preset NAME: PRESETS[NAME], overrides of PPO's fields (ppo-max, vanilla, moss-release, dapo, vapo);
  3. what the run trains on, for the fields neither given nor set by the preset: DATA_PRESET with --data and the
     tiny model (a budget for real text on a CPU); MODEL_PRESETS[--model] for llama-7b / llama-13b (the paper's
     hyperparameters); REAL_MODEL_PRESET for any real --model (ptx on its SFT text: it has no synthetic
     pretraining text); real text keeps the paper's η 0.05 and λ_ptx 0.5; WORLD_B_PRESET with --world b (world B's
     pilot rule's answer: docs/worlds.md);
  4. implied(): an estimator's own conventions (Dr. GRPO's loss divisor, GRPO's k3 when the KL sits in the loss).
So `python train.py` runs these defaults with nothing on top (PRESETS["ppo-max"] is empty). The synthetic world's own
knobs (`--world-*`) are toy_world.WorldConfig (`--world b`: world B, toy_world_b.py, with the defaults its pilot
rule set: WORLD_B_PRESET, docs/worlds.md); the flags of `--plan` are plumbing/scale.py's.

Flags a run ignores. A flag given on the command line that the run would not read is refused before any work
(one line `error: …` naming it, exit 2), since a run that quietly ignores it is not the run asked for:
  * --method dpo / best-of-n (no PPO loop): a --preset other than ppo-max; every PPO flag but --max-new-tokens (the
    evaluation's length cap, which every method samples with) and, for dpo, --policy-init (where DPO starts); the
    loop's own flags (--break-at, --save-every, --keep-last, --heldout-every, --heldout-samples, --max-bad-steps,
    --on-collapse, --alarm-*, --log-with, --critic-model); --resume.
  * --dpo-beta, --dpo-lr, --dpo-eval-every without --method dpo; --bon-n without --method best-of-n.
  * a critic-free --advantage: the critic's flags (--critic-lr, --critic-init, --value-clip, --vf-coef, --lam,
    --lam-critic, --lam-adaptive, --critic-pretrain-target, --critic-pretrain-steps but 0, --critic-model, --stages
    ending in critic).
  * a setting that acts only through another that is off: --kl-target without η (--kl-coef 0), --kl-horizon without
    --kl-target, --entropy-clip without --entropy-coef, --adv-clip without --adv-norm, --reward-clip without
    --reward-norm (0 = off is always accepted), --ptx-data without --ptx-coef, --heldout-samples with
    --heldout-every 0, --overlong-penalty without --overlong-buffer, --cispo-eps-* without --policy-loss cispo,
    --rollout-correction-cap without --rollout-correction, --rollout-correction-level without --rollout-correction
    mis, --lora-alpha / --lora-dropout / --lora-targets without --lora-r, --lora-bits without --lora-r.
  * the synthetic world's --world-* flags with --data or a real --model; --data's own flags (--data-split,
    --data-config, --skip-bad, --heldout-frac, --vocab-size, --max-prompt-tokens, --max-response-tokens,
    --judge-frac) in the synthetic world; --rebuild-base with --resume (a resume continues on the stages it trained).
The documented exception is a method's budget (plumbing/flags.py BUDGET: --steps, --rollout-batch, --minibatch,
--critic-pretrain-steps, and an explicit --preset ppo-max; DPO_BUDGET: --dpo-epochs, --dpo-batch): one budget is
passed to every method alike (notebooks/runs.py's small budget, the tests' TINY lists), so where a method without
PPO leaves it unused it is accepted and said once, in a line `[flags] … not used`. Inside PPO the rule holds without
exception: a critic-free --advantage refuses --critic-pretrain-steps (but 0) as it refuses every critic flag.
The loop also needs --minibatch to divide --rollout-batch (equal minibatches; they are drawn shuffled, so a group of
G responses is never kept within one minibatch and needs no alignment there) and --break-at inside the run (0 …
--steps − 1, or -1).

Symbols: B rollout batch, G group size, T response length cap, η KL coefficient (Eq. 19), δ reward clip (Eq. 18),
ε PPO clip (Eq. 15), γ discount, λ GAE (Eq. 9), λ_ptx (Eq. 17), β_rm (Eq. 2), β of DPO (Rafailov et al., Eq. 7).
plumbing/flags.py turns these fields into the parser, checks every value against its `allowed` range before any
work, and records the resolved configuration of a run for --resume.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from plumbing.cli import arg
from plumbing.monitor import KL_MAX, PATIENCE  # the collapse alarm's defaults live with the alarm


@dataclass
class RunConfig:
    preset: str = arg("ppo-max", "a named set of PPO flags (PRESETS, below): ppo-max, vanilla, moss-release, dapo, vapo")
    seed: int = arg(0, "seed of the world, every model init and every sample", "[0,2147483647]")
    world: str = arg("a", "the synthetic world: 'a' (toy_world.py: lists and refusals; annotators favour length) or "
                          "'b' (toy_world_b.py: short questions; annotators favour flattery): docs/worlds.md", "a|b")
    steps: int = arg(80, "PPO iterations (each: one rollout batch, then PPO epochs over it)", ">=1")
    out: str = arg("", "output directory (default runs/<preset>-seed<seed>; with --lora-r R: "
                       "runs/<preset>-loraR-seed<seed>; a default that holds a run: the next free -2, -3, ...)")
    overwrite: bool = arg(False, "replace the run --out holds (its checkpoints and summary are removed); without it "
                                 "a run into a folder that holds a finished or resumable run stops")
    model: str = arg("tiny", "policy/SFT model: 'tiny' (synthetic world), an alias, a hub id or a local HF directory")
    eval_samples: int = arg(4, "samples per held-out prompt for the final evaluation and win rate", ">=1")
    heldout_every: int = arg(8, "the held-out curve: every N PPO steps (at the top of steps 0, N, 2N, ...: step 0 is "
                                "the SFT policy) sample the held-out prompts as the final evaluation does and log "
                                "metrics.jsonl's heldout/* (the judge's mean, the proxy's, KL, length); training is "
                                "unchanged (the samples draw from a stream of their own); 0 = off", ">=0")
    heldout_samples: int = arg(1, "samples per held-out prompt at each --heldout-every point", ">=1")
    threads: int = arg(1, "torch CPU threads (0 = torch's default); the tiny models gain nothing from more, and on a "
                          "shared machine extra threads mostly wait for each other", ">=0")
    break_at: int = arg(-1, "call breakpoint() at the top of PPO step STEP, 0 … --steps − 1 (pdb: `n` walks steps "
                            "(0)-(7)); with --critic-pretrain-steps 0 it stops within seconds; -1 = never", ">=-1")
    rebuild_base: bool = arg(False, "train stages 1-2 (SFT, reward model) again even when runs/_base or --out holds "
                                    "them")
    stages: str = arg("sft,rm,critic,ppo", "the stages to run, in order (sft, rm, critic, ppo); the run stops after "
                                           "the last one listed, e.g. sft,rm trains only a reward model")
    method: str = arg("ppo", "what follows SFT and the reward model, in place of critic + PPO: 'ppo' (the numbered "
                             "loop; --advantage picks GAE or a critic-free estimator), 'dpo' (dpo.py: Eq. 7 on the "
                             "reward model's own pairs, no sampling, no critic) or 'best-of-n' (no training: the best "
                             "of --bon-n SFT samples by the proxy). A method, not a stage, because it replaces stages "
                             "3-4 rather than following them; every method ends with the same held-out evaluation",
                      "ppo|dpo|best-of-n")
    bon_n: int = arg(16, "--method best-of-n: candidates per response; KL to SFT = log n − (n − 1)/n nats", ">=1")
    # long runs (checkpoint.py, monitor.py)
    save_every: int = arg(20, "write a checkpoint every N PPO steps (and at the end); 0 = only at the end", ">=0")
    keep_last: int = arg(3, "checkpoints kept under <out>/checkpoints (older ones are deleted once a newer one is "
                            "complete, so a save needs room for one more); 0 = keep every checkpoint", ">=0")
    resume: str = arg("", "continue a run exactly: its directory or one of its checkpoints (same flags as the run)")
    max_bad_steps: int = arg(3, "stop after this many consecutive steps with a non-finite score/advantage/gradient",
                             ">=1")
    on_collapse: str = arg("warn", "when the §5.2 collapse alarm fires: 'warn' (log it) or 'stop' (checkpoint, stop)",
                           "warn|stop")
    alarm_kl_max: float = arg(KL_MAX, "collapse alarm: KL to the reference (nats/token) that makes a step "
                                               "bad; higher is quieter and later (`python -m plumbing.monitor sweep runs/*`)",
                              ">=0")
    alarm_patience: int = arg(PATIENCE, "collapse alarm: consecutive bad steps before it fires", ">=1")
    log_with: str = arg("none", "also log every metric (PPO steps, the SFT and reward-model stages) to 'tensorboard' "
                                "(<out>/tensorboard) or 'wandb' (offline with WANDB_MODE=offline); metrics.jsonl is "
                                "always written", "none|tensorboard|wandb")
    # real preference data instead of the synthetic world (data.py reads and checks it)
    data: str = arg("", "preference pairs (HH-RLHF, {prompt,chosen,rejected} or chat messages) as .jsonl[.gz], .json, "
                        ".parquet, a Dataset.save_to_disk folder or a hub dataset id in the local cache: real text "
                        "instead of the synthetic world (flags not given take the real-data preset, DATA_PRESET)")
    data_split: str = arg("train", "with --data as a hub id or a folder of several splits: the split to read")
    data_config: str = arg("", "with --data as a hub id: its configuration (name), if it has several")
    skip_bad: bool = arg(False, "with --data: skip bad lines, count them by reason, report at the end (else exit 2)")
    heldout_frac: float = arg(0.1, "with --data: fraction of pairs held out for RM accuracy and evaluation prompts",
                              "(0,1)")
    vocab_size: int = arg(2000, "with --data: byte-level BPE vocabulary, trained on the training split only "
                                 "(at least its 256 bytes and 4 special tokens)", ">=260")
    max_prompt_tokens: int = arg(128, "with --data: P limit on the query as the model reads it (BOS or chat template "
                                      "included); longer prompts keep their latest turns; lowered to fit a real "
                                      "--model's positions", ">=1")
    max_response_tokens: int = arg(64, "with --data: T limit (EOS included); longer pairs are dropped and counted; "
                                       "lowered to fit a real --model's positions",
                                   ">=2")
    judge_frac: float = arg(0.5, "with --data: fraction of the training pairs held back for a second reward model, "
                                 "the judge of the win rate, which PPO never optimises; 0 = judge by the proxy",
                            "[0,1)")
    # real models and scale (plumbing/scale.py, plumbing/engine.py): `--plan`, `deepspeed train.py ...`
    plan: bool = arg(False, "print the per-GPU memory plan of --model and exit, loading no weights (more flags: "
                            "--num-gpus --gpu-mem --micro-batch --prompt-len ...; see `python -m plumbing.scale --help`)")
    sft_model: str = arg("", "real --model: an SFT model, so stage 1 is skipped (policy and reference init); without "
                             "it, stage sft trains --model on --sft-data or --data, and with neither --model itself is "
                             "the SFT model")
    sft_data: str = arg("", "SFT and ptx data ({prompt,response}, {prompt,chosen}, {messages} or {text} lines) "
                            "instead of the chosen responses of --data")
    reward_model: str = arg("", "real --model: a reward model directory, so stage 2 is skipped (ours, or an "
                                "AutoModelForSequenceClassification with num_labels 1)")
    critic_model: str = arg("", "real --model: the critic init (default: the reward model, as PPO-max)")
    prompts: str = arg("", "a .jsonl[.gz] of {\"prompt\"} lines for the rollouts instead of --data's training prompts "
                           "(lines that are --data's held-out or judge prompts are left out); without --data it is "
                           "split by --heldout-frac into rollout and evaluation prompts")
    deepspeed: bool = arg(False, "DeepSpeed engines even in one process (automatic under the `deepspeed` launcher)")
    deepspeed_config: str = arg("", "DeepSpeed JSON for policy and critic (e.g. ds_config_zero2.json) instead of the "
                                    "one built from these flags; its micro batch is set to minibatch / ranks")
    zero_stage: int = arg(2, "ZeRO stage of the policy and critic engines: 0, 1 or 2 (the paper: 2)", "0|1|2")
    grad_ckpt: bool = arg(False, "gradient checkpointing in policy and critic (on in the llama presets)")
    fp32: bool = arg(False, "fp32 where bf16 would be used (DeepSpeed on an accelerator with bf16; never the CPU)")
    bf16: bool = arg(False, "bf16 for every model even on the CPU (the accelerator's dtype path, testable here)")
    # one GPU (lora.py): low-rank adapters through peft instead of full weights
    frozen_zero_stage: int = arg(0, "the frozen models (reference, the reward model when it only scores, the judge) "
                                    "under DeepSpeed: 0 = a copy on every rank; 3 = ZeRO-3 inference engines, their "
                                    "parameters partitioned over the ranks and gathered layer by layer (the llama "
                                    "presets; needs the launcher or --deepspeed)", "0|3")
    frozen_offload: bool = arg(False, "the frozen models' parameters on the CPU (ZeRO-3 offload_param, as the paper's "
                                      "code runs them; implies --frozen-zero-stage 3; needs the launcher or "
                                      "--deepspeed)")
    lora_r: int = arg(0, "LoRA rank r: train adapters (peft) instead of full weights, in SFT, the reward model, the "
                         "critic and the policy (the synthetic world: critic and policy); 0 = full fine-tuning", ">=0")
    lora_alpha: float = arg(16.0, "LoRA α: the update is (α/r)·B·A", ">0")
    lora_dropout: float = arg(0.0, "dropout on the adapters' input in SFT and reward-model training (PPO switches it "
                                   "off with every dropout: ρ = 1 on the first minibatch)", "[0,1)")
    lora_targets: str = arg("auto", "layers that get adapters: 'auto' (peft's default for the architecture: "
                                    "q_proj,v_proj for LLaMA, c_attn for GPT-2), 'all-linear', or names, e.g. "
                                    "q_proj,k_proj,v_proj,o_proj")
    lora_bits: int = arg(16, "frozen base weights under LoRA: 16 (bf16 / as saved), 8 or 4 (bitsandbytes NF4, "
                             "QLoRA; CUDA only, one process)", "4|8|16")


@dataclass
class SFTConfig:
    sft_hidden: int = arg(64, "hidden size of the tiny LLaMA", ">=1")
    sft_layers: int = arg(2, "transformer layers of the tiny LLaMA", ">=1")
    sft_heads: int = arg(4, "attention heads of the tiny LLaMA", ">=1")
    sft_epochs: float = arg(3.0, "epochs over the SFT demonstrations", ">0")
    sft_lr: float = arg(3e-3, "SFT learning rate (AdamW, cosine decay)", ">0")
    sft_batch: int = arg(64, "SFT batch size (sequences)", ">=1")

@dataclass
class RMConfig:
    rm_epochs: float = arg(2.0, "epochs over the training preference pairs (paper ~1.06)", ">0")
    rm_lr: float = arg(1e-3, "reward-model learning rate (paper 5e-6 at 7B)", ">0")
    rm_batch: int = arg(32, "pairs per step", ">=1")
    rm_lm_coef: float = arg(1.0, "β_rm of Eq. 2: weight of the LM loss on the chosen response (paper 1)", ">=0")
    rm_eval_every: int = arg(10, "steps between held-out accuracy evaluations (Fig. 3)", ">=1")
    # the proxy's own size and data, for the over-optimisation curve (Gao et al. 2022): the synthetic world and --data
    rm_hidden: int = arg(0, "hidden size of the reward model (its backbone is then an LM of that size trained like "
                            "stage 1 on the same demonstrations); 0 = the SFT model's, as the paper", ">=0")
    rm_layers: int = arg(0, "layers of the reward model's own backbone (with --rm-hidden); 0 = the SFT model's", ">=0")
    rm_pairs: int = arg(0, "train the reward model (and DPO) on the first N training pairs only; 0 = all", ">=0")

@dataclass
class PPOConfig:
    """Every trick of the paper is a field; presets (below) are named sets of overrides. Defaults = PPO-max (§5.4)
    at the synthetic world's scale. Field docs become `python train.py --help`."""
    # --- sampling (rollouts) ---
    rollout_batch: int = arg(64, "responses per PPO iteration ('sampling batch'; paper 128): prompts × --group-size",
                             ">=1")
    group_size: int = arg(1, "G: responses sampled per prompt, kept together (on one rank under DeepSpeed); the group "
                             "estimators (grpo, dr-grpo, rloo, reinforce++-baseline) need G ≥ 2", ">=1")
    minibatch: int = arg(16, "sequences per gradient step (paper 32); divides --rollout-batch", ">=1")
    ppo_epochs: int = arg(2, "passes over each rollout batch ('small experience buffer', §5.4)", ">=1")
    max_new_tokens: int = arg(24, "response length cap T", ">=1")
    generate_batch: int = arg(0, "prompts per GPU generated, scored and read for log-probs and values at once: the "
                                 "rollout batch in micro-batches of this many (the update still takes the whole "
                                 "batch); must divide the rollout batch per GPU; 0 = all at once", ">=0")
    temperature: float = arg(1.0, "rollout sampling temperature T: samples from π^(1/T), and the log-probs of the "
                                  "ratio and the KL are those of π^(1/T) too (1 = π itself)", ">0")
    # --- optimisation ---
    policy_lr: float = arg(7e-5, "α for π_θ (paper 5e-7 at 7B)", ">=0")
    critic_lr: float = arg(5e-4, "α for V_φ (paper 1.65e-6 at 7B)", ">=0")
    warmup_frac: float = arg(0.0, "linear LR warm-up fraction (paper 0.1; PPO-max replaces it by critic "
                                  "pre-training)", "[0,1]")
    grad_clip: float = arg(1.0, "global gradient-norm clip; 0 = off (Fig. 18)", ">=0")
    # --- score reparameterisation (Fig. 6, 14) ---
    reward_norm: bool = arg(True, "Eq. 18: normalise scores with running mean/std")
    reward_clip: float = arg(5.0, "δ of Eq. 18 (clip after normalising); 0 = no clip", ">=0")
    reward_scale: bool = arg(False, "reward scaling: r / running std (ablation)")
    adv_norm: bool = arg(False, "whiten advantages per minibatch")
    adv_clip: float = arg(0.0, "clip whitened advantages to ±δ; 0 = off", ">=0")
    # --- policy constraints (Fig. 7, 15, 16) ---
    kl_coef: float = arg(0.2, "η of Eq. 19 (token-level KL penalty); 0 = off. The paper: 0.05 (Fig. 7), 0.05/0.1/0.2 "
                              "(Fig. 15); 0.2 here: the operating point (docs/findings.md)", ">=0")
    kl_estimator: str = arg("k1", "per-token KL in the penalty: k1 (sampled log-ratio, Eq. 19) | k2 | k3 | full "
                                  "(exact)", "k1|k2|k3|full")
    kl_target: float = arg(0.0, "adaptive KL controller target, in nats PER TOKEN (kl/ref; Ziegler et al. 2019 "
                                "state it per sequence: divide by the mean response length); 0 = fixed η", ">=0")
    kl_horizon: int = arg(10000, "adaptive KL horizon (in sequences)", ">=1")
    importance_sampling: bool = arg(False, "ratio against π_ref instead of π_old: the 'infinite buffer' of §5.3.2")
    entropy_coef: float = arg(0.0, "entropy bonus weight (paper 0.01)", ">=0")
    entropy_clip: float = arg(0.0, "the bonus stops acting above this mean entropy (Fig. 16); 0 = no clip", ">=0")
    # --- the advantage estimator (gae.py: Eq. 9 with the critic; critic_free.py without one) ---
    advantage: str = arg("gae", "advantage estimator: gae (Eq. 9, a critic V_φ) or, with no critic at all (none is "
                                "built, pre-trained or checkpointed): grpo, dr-grpo (also sets --loss-agg "
                                "seq-mean-token-sum-norm), rloo, reinforce++, reinforce++-baseline (docs/methods.md)",
                         "gae|grpo|dr-grpo|rloo|reinforce++|reinforce++-baseline")
    kl_in: str = arg("reward", "where the KL to π_SFT acts: 'reward' (Eq. 19: −η·KL_t in every r_t) or 'loss' "
                               "(GRPO: + η·KL_t added to the policy loss; --kl-estimator k3 unless given: GRPO's, "
                               "whose gradient is that of KL(π_SFT‖π); k2's is that of KL(π‖π_SFT))", "reward|loss")
    # --- conventions of other implementations (docs/differences.md); the defaults are ours ---
    loss_agg: str = arg("token-mean", "policy-loss aggregation (verl loss_agg_mode): token-mean (ours, OpenRLHF "
                                      "token_level_loss, TRL bnpo) | seq-mean-token-mean (TRL grpo, OpenRLHF "
                                      "--no-token_level_loss) | seq-mean-token-sum-norm (Dr. GRPO: Σ / (batch × "
                                      "--max-new-tokens); TRL dr_grpo)",
                        "token-mean|seq-mean-token-mean|seq-mean-token-sum-norm")
    dual_clip: float = arg(0.0, "dual-clip PPO c > 1: for Â < 0 the objective is at least c·Â (verl clip_ratio_c, on "
                                "by default there at 3; OpenRLHF --dual_clip); 0 = off", ">=0")
    log_ratio_clamp: float = arg(0.0, "clamp log(π_θ/π_θold) to ±C before exp (OpenRLHF and verl: 20); 0 = off",
                                 ">=0")
    kl_clamp: float = arg(0.0, "clamp every sampled KL_t (k1, k2, k3) to ±C (OpenRLHF compute_approx_kl: 10 for every "
                               "estimator; verl kl_penalty: 10 for k3 only); 0 = off", ">=0")
    # --- PPO core (Eq. 15, 16) ---
    clip_eps: float = arg(0.2, "ε of PPO-clip (Fig. 17)", ">=0")
    value_clip: float = arg(0.2, "value-loss clip range; 0 = off", ">=0")
    vf_coef: float = arg(1.0, "critic loss weight (critic has its own optimiser; kept for parity)", ">=0")
    gamma: float = arg(1.0, "γ", "[0,1]")
    lam: float = arg(0.9, "GAE λ (Fig. 19)", "[0,1]")
    # --- ptx (Eq. 17) ---
    ptx_coef: float = arg(0.25, "λ_ptx of Eq. 17: weight of the LM loss on --ptx-data's text; 0 = off", ">=0")
    ptx_batch: int = arg(16, "SFT sequences per ptx term", ">=1")
    ptx_data: str = arg("sft", "D of Eq. 17: 'sft' (the SFT demonstrations; on real data the only one: --sft-data or "
                               "--data) or 'pretrain' (the synthetic world's pretraining text, responses without "
                               "prompts: the paper's D_pretrain)", "sft|pretrain")
    # --- initialisation (Fig. 8) ---
    critic_pretrain_steps: int = arg(30, "max rollout batches of critic pre-training (stops early on plateau); "
                                         "0 = off", ">=0")
    critic_init: str = arg("rm", "initialise the critic from the reward model ('rm') or the SFT model ('sft')",
                           "rm|sft")
    policy_init: str = arg("sft", "'sft' or 'pretrained' (the non-SFT LM; Fig. 8)", "sft|pretrained")
    # --- what PPO gained since the paper (docs/methods.md); each off by default: the paper's PPO-max as above ---
    clip_eps_high: float = arg(None, "ε_high of DAPO's clip-higher: clip(ρ, 1 − ε, 1 + ε_high) (DAPO: ε 0.2, ε_high "
                                     "0.28); default: equal to --clip-eps", ">=0")
    ratio: str = arg("token", "the importance ratio: 'token' (ρ_t, Eq. 15) or 'sequence' (GSPO: the length-normalised "
                              "sequence ratio s_i = (π_θ(y|x)/π_old(y|x))^(1/|y|), clipped per sequence, in its token "
                              "form; implies --loss-agg seq-mean-token-mean unless given)", "token|sequence")
    policy_loss: str = arg("ppo-clip", "'ppo-clip' (Eq. 15) or 'cispo' (MiniMax-M1: −sg(clip(ρ_t, 1 − ε_low, 1 + "
                                       "ε_high))·Â_t·log π_θ(y_t), every token keeps its gradient)", "ppo-clip|cispo")
    cispo_eps_low: float = arg(1.0, "ε_low of CISPO's weight clip; 1 = no lower bound (ρ ≥ 0)", "[0,1]")
    cispo_eps_high: float = arg(4.0, "ε_high of CISPO's weight clip: the weight is at most 1 + ε_high (ScaleRL: 5)",
                                ">=0")
    lam_critic: float = arg(None, "λ of the critic's targets (VC-PPO, VAPO: 1, Monte-Carlo returns), --lam then only "
                                  "for the advantages; default: --lam for both (Eq. 9)", "[0,1]")
    lam_adaptive: float = arg(0.0, "α of VAPO's length-adaptive λ_policy = 1 − 1/(α·l) per response of l tokens "
                                   "(VAPO: 0.05 for its thousands of tokens); 0 = off (--lam)", ">=0")
    critic_pretrain_target: str = arg("gae", "what critic pre-training regresses on: 'gae' (PPO-max: the returns of "
                                             "--lam, Eq. 16) or 'returns' (VC-PPO: Monte-Carlo returns, λ = 1, of the "
                                             "fixed SFT policy)", "gae|returns")
    dynamic_sampling: bool = arg(False, "DAPO's dynamic sampling, with --group-size G > 1: groups whose proxy scores do "
                                        "not spread (max − min ≤ 1e-6) are dropped and the batch refilled from more "
                                        "prompts (at most 8 rounds), counted in dynamic/*")
    overlong_buffer: int = arg(0, "DAPO's overlong reward shaping: a penalty growing linearly over the last L tokens "
                                  "before --max-new-tokens, −P at the cap (on the normalised score); 0 = off", ">=0")
    overlong_penalty: float = arg(1.0, "P of --overlong-buffer: the penalty at the length cap", ">=0")
    rollout_mismatch: str = arg("none", "sample the rollout through a path that differs from the trainer's in one "
                                        "known way: 'bf16' (a bf16 copy of the policy), 'top-p' (nucleus sampling, "
                                        "p 0.9, while the trainer's log-probs are the full distribution's), 'stale' "
                                        "(the previous step's weights, as an asynchronous run); the sampler's own "
                                        "log-probs are kept and mismatch/* logged every step",
                                "none|bf16|top-p|stale")
    rollout_correction: str = arg("none", "correct the policy loss for tokens the sampler drew: 'tis' (truncated "
                                          "importance sampling, w_t = min(π_old/π_rollout, C)) or 'mis' (masked: "
                                          "tokens, or sequences with --rollout-correction-level sequence, whose ratio "
                                          "leaves [1/C, C] leave the loss)", "none|tis|mis")
    rollout_correction_cap: float = arg(2.0, "C of --rollout-correction (verl's TIS: 2)", ">=1")
    rollout_correction_level: str = arg("token", "where --rollout-correction mis masks: 'token' or 'sequence' (the "
                                                 "sequence ratio Π_t ρ_t, as verl)", "token|sequence")


@dataclass
class DPOConfig:
    dpo_beta: float = arg(0.1, "β of Eq. 7: the strength of the implicit KL constraint to π_SFT (paper and TRL: 0.1)",
                          ">0")
    dpo_lr: float = arg(5e-4, "DPO learning rate (AdamW, cosine decay; TRL's default 1e-6 is for 7B models)", ">0")
    dpo_epochs: float = arg(2.0, "epochs over the preference pairs (those the reward model trains on)", ">0")
    dpo_batch: int = arg(32, "pairs per step", ">=1")
    dpo_eval_every: int = arg(10, "steps between held-out implicit-reward accuracies", ">=1")


# --preset NAME: named overrides of PPOConfig.
PRESETS: dict[str, dict] = {
    "ppo-max": {},
    "vanilla": dict(reward_norm=False, reward_clip=0.0, kl_coef=0.0, critic_pretrain_steps=0, ptx_coef=0.0,
                    value_clip=0.0, grad_clip=0.0),
    # the settings of the scripts released with the paper (docs/differences.md): reward scaling by the running std
    # (no centring, no clip), η = 0.01 (its English runs), no critic pre-training, no ptx, no advantage
    # normalisation, and one optimizer step per rollout batch (its per-GPU batches of 2: the ratio is 1, the clip
    # never binds)
    "moss-release": dict(reward_norm=False, reward_clip=0.0, reward_scale=True, kl_coef=0.01, critic_pretrain_steps=0,
                         ptx_coef=0.0, adv_norm=False, minibatch=64, ppo_epochs=1),
    # DAPO (Yu et al. 2025, arXiv 2503.14476): GRPO's group advantage, clip-higher, dynamic sampling, the token-level
    # loss and overlong shaping, no KL penalty, no critic; on this world's scale (docs/methods.md says what differs)
    "dapo": dict(advantage="grpo", group_size=4, clip_eps=0.2, clip_eps_high=0.28, dynamic_sampling=True,
                 overlong_buffer=4, overlong_penalty=1.0, kl_coef=0.0, reward_norm=False, reward_clip=0.0,
                 critic_pretrain_steps=0, ptx_coef=0.0),
    # VAPO (Yue et al. 2025, arXiv 2504.05118): PPO with a critic pre-trained on Monte-Carlo returns, decoupled λ
    # (λ_critic 1, a length-adaptive λ_policy), clip-higher and the token-level loss, no KL penalty; α = 1 gives
    # λ_policy ≈ 0.9 at this world's ~9 tokens (VAPO's α = 0.05 is for thousands)
    "vapo": dict(critic_pretrain_target="returns", lam_critic=1.0, lam_adaptive=1.0, clip_eps=0.2, clip_eps_high=0.28,
                 kl_coef=0.0, ptx_coef=0.0),
}

# --data with the tiny model: real text on a CPU in minutes (a smaller model and budget; its timings:
# docs/real-data.md). Real text has no pretraining split: ptx reads --sft-data or --data.
# The operating point (η 0.2, ptx 0.25) was chosen in the synthetic world; real text keeps the paper's η 0.05 and
# λ_ptx 0.5, as it was measured with.
DATA_PRESET = dict(sft_hidden=128, sft_epochs=2.0, sft_batch=32, rm_epochs=1.0, rm_lr=5e-4, steps=10,
                   rollout_batch=32, max_new_tokens=32, critic_pretrain_steps=4, eval_samples=1, ptx_data="sft",
                   kl_coef=0.05, ptx_coef=0.5)

# --model llama-7b / llama-13b: the paper's hyperparameters (its section 5 and appendix). The reward model: lr 5e-6, about
# 1.06 epochs, β_rm = 1 (the paper's dynamic batches of 4-128 sequences: 64 pairs). The paper reports no SFT
# settings; these are Alpaca's for LLaMA-7B (Taori et al. 2023): lr 2e-5, 3 epochs, batch 128. bf16 comes with
# DeepSpeed on an accelerator that has it; the final evaluation always samples as the paper evaluates.
# The lengths are those of the paper's released script (MOSS-RLHF train_ppo_en.sh: --maxlen_prompt 2048 --maxlen_res
# 512, so a prompt is cut to 2048 − 512 = 1536 tokens, dropping its oldest turns first, as data.fit_prompt does here;
# the paper itself says "max length 2048"); the frozen models are ZeRO-3 engines as that code builds them, 4 prompts
# per GPU are generated and scored at a time (its code: 2), and the update takes the paper's batches
# (docs/real-scale.md).
PAPER_LLAMA = dict(policy_lr=5e-7, critic_lr=1.65e-6, warmup_frac=0.1, rollout_batch=128, minibatch=32, lam=0.9,
                   clip_eps=0.2, kl_coef=0.05, grad_ckpt=True, rm_lr=5e-6, rm_epochs=1.06, rm_batch=64, rm_lm_coef=1.0,
                   sft_lr=2e-5, sft_epochs=3.0, sft_batch=128, max_prompt_tokens=1536, max_new_tokens=512,
                   max_response_tokens=512, frozen_zero_stage=3, generate_batch=4)
MODEL_PRESETS = {"llama-7b": PAPER_LLAMA, "llama-13b": PAPER_LLAMA}

# any real --model: ptx (Eq. 17) on its SFT text, since only the synthetic world has a pretraining split, and the
# paper's η 0.05 and λ_ptx 0.5 (the operating point is the synthetic world's)
REAL_MODEL_PRESET = dict(ptx_data="sft", kl_coef=0.05, ptx_coef=0.5)


# --world b: world B's defaults, set by its pilot rule (docs/worlds.md), not tuned to any claim: the rule chose world
# A's SFT rate (3e-3), policy rate (7e-5, the critic's at A's ratio) and operating point (η 0.2, ptx on the
# demonstrations at 0.25), and a reward-model rate of 1e-2 (A's: 1e-3). Only what differs is written here; the pilot's
# record, notebooks/results/world-b/, is what a test holds this preset to.
WORLD_B_PRESET = dict(rm_lr=1e-2)


def context_presets(data: str, model: str, world: str = "a") -> list[tuple[str, dict]]:
    """Layer 3: the presets of what the run trains on, in order, as (name, overrides)."""
    layers = []
    if world == "b" and not data and model == "tiny":
        layers.append(("world b", WORLD_B_PRESET))
    if data and model == "tiny":
        layers.append(("real-data", DATA_PRESET))
    if model in MODEL_PRESETS:
        layers.append((model, MODEL_PRESETS[model]))
    if model != "tiny":
        layers.append(("real model", REAL_MODEL_PRESET))
    return layers


def apply_preset(name: str, **overrides) -> PPOConfig:
    """PPOConfig of a preset (layers 1-2), with `overrides` on top."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}")
    return dataclasses.replace(PPOConfig(), **{**PRESETS[name], **overrides})


def implied(cfg: PPOConfig, given: set[str]) -> PPOConfig:
    """Layer 4, for the flags not in `given`: Dr. GRPO is its advantage AND its constant loss divisor (--loss-agg
    seq-mean-token-sum-norm); the KL in the loss is GRPO's k3 (--kl-estimator k3); GSPO's sequence ratio comes with
    its per-sequence mean (--loss-agg seq-mean-token-mean). A flag given that contradicts
    them is refused by plumbing/flags.py."""
    changes = {}
    if cfg.advantage == "dr-grpo" and "loss_agg" not in given:
        changes["loss_agg"] = "seq-mean-token-sum-norm"
    if cfg.kl_in == "loss" and "kl_estimator" not in given:
        changes["kl_estimator"] = "k3"
    if cfg.ratio == "sequence" and "loss_agg" not in given:  # GSPO: its sequence ratio with a per-sequence mean
        changes["loss_agg"] = "seq-mean-token-mean"
    return dataclasses.replace(cfg, **changes)


# `python train.py --help`: the flags of a first reading, by stage (`--help-all`: every flag of every dataclass above)
FIRST_READING: dict[str, list[str]] = {
    "run": ["preset", "seed", "world", "steps", "out", "overwrite", "stages", "method", "resume", "break_at", "threads",
            "log_with"],
    "real text and real models": ["data", "model", "lora_r", "plan"],
    "1. SFT": ["sft_epochs", "sft_lr", "sft_batch"],
    "2. reward model (Eq. 1-2)": ["rm_epochs", "rm_lr", "rm_lm_coef"],
    "3. critic pre-training (§5.3.3)": ["critic_pretrain_steps", "critic_init"],
    "4. PPO (Eq. 15-19)": ["rollout_batch", "minibatch", "ppo_epochs", "max_new_tokens", "policy_lr", "critic_lr",
                           "reward_norm", "reward_clip", "kl_coef", "clip_eps", "value_clip", "gamma", "lam",
                           "ptx_coef", "grad_clip", "advantage", "group_size"],
    "evaluation": ["eval_samples", "heldout_every"],
    "other methods": ["bon_n", "dpo_beta"],
}
