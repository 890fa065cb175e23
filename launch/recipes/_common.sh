# Shared by the recipe scripts: maps the seed document's environment variables to relax-train overrides.
#   MODEL_DIR   weights are read from $MODEL_DIR/<model name> (MODEL_PATH=... sets model.path exactly)
#   DATA_DIR    datasets (GSM8K: $DATA_DIR/gsm8k); RLOO_DATA_CACHE_DIR: where prepared data is cached
#   EXP_DIR     run and sweep directories, the MLflow store ($EXP_DIR/mlflow.db) and the sweep scripts' compare/;
#               the checkpoints stay in checkpoints/ of the current directory (relax-train's default)
#   ADVANTAGE_ESTIMATOR  algorithm=<it>, e.g. grpo for the control arm of the same recipe and seed
#   SEED        seed=<it>
# Any argument is passed on as an override: bash launch/recipes/<recipe>.sh train.num_rollout=10 dry_run=true
run_recipe() {
  local name=$1
  shift
  local args=("+experiment=${name}")
  if [[ -n "${ADVANTAGE_ESTIMATOR:-}" ]]; then args+=("algorithm=${ADVANTAGE_ESTIMATOR}"); fi
  if [[ -n "${MODEL_PATH:-}" ]]; then args+=("model.path=${MODEL_PATH}"); fi
  if [[ -n "${SEED:-}" ]]; then args+=("seed=${SEED}"); fi
  if [[ -n "${EXP_DIR:-}" ]]; then
    mkdir -p "${EXP_DIR}"
    local exp_dir
    exp_dir=$(cd "${EXP_DIR}" && pwd)
    args+=("hydra.run.dir=${exp_dir}/${name}/\${now:%Y-%m-%d_%H-%M-%S}"
           "hydra.sweep.dir=${exp_dir}/${name}/multirun/\${now:%Y-%m-%d_%H-%M-%S}"
           "tracking.uri=sqlite:///${exp_dir}/mlflow.db")
  fi
  echo "+ relax-train ${args[*]} $*" >&2
  exec relax-train "${args[@]}" "$@"
}

# For the sweep scripts: sets `uri` (the MLflow store), `extra` (sweep directory and store overrides) and
# `records_dir` (where the comparison writes compare/) from EXP_DIR (default: the current directory holds them all).
sweep_dirs() {
  local name=$1
  uri="sqlite:///mlflow.db"
  extra=()
  records_dir="."
  if [[ -n "${EXP_DIR:-}" ]]; then
    mkdir -p "${EXP_DIR}"
    local exp_dir
    exp_dir=$(cd "${EXP_DIR}" && pwd)
    uri="sqlite:///${exp_dir}/mlflow.db"
    records_dir="${exp_dir}"
    extra+=("hydra.sweep.dir=${exp_dir}/${name}/multirun/\${now:%Y-%m-%d_%H-%M-%S}" "tracking.uri=${uri}")
  fi
}

# relax-compare of the sweep's store (`uri`), run in `records_dir` (sweep_dirs): its compare/<sweep id or time>/
# goes under EXP_DIR when it is set. Arguments are relax-compare's.
run_compare() {
  (cd "${records_dir}" && relax-compare --uri "${uri}" "$@")
}
