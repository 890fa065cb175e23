# Shared by the recipe scripts: maps the seed document's environment variables to relax-train overrides.
#   MODEL_DIR   weights are read from $MODEL_DIR/<model name> (MODEL_PATH=... sets model.path exactly)
#   DATA_DIR    datasets (GSM8K: $DATA_DIR/gsm8k); RLOO_DATA_CACHE_DIR: where prepared data is cached
#   EXP_DIR     run and sweep directories (checkpoints inside) and the MLflow store: $EXP_DIR/mlflow.db
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

# For the sweep scripts: sets `uri` (the MLflow store) and `extra` (sweep directory and store overrides) from
# EXP_DIR (default: the current directory holds both).
sweep_dirs() {
  local name=$1
  uri="sqlite:///mlflow.db"
  extra=()
  if [[ -n "${EXP_DIR:-}" ]]; then
    mkdir -p "${EXP_DIR}"
    local exp_dir
    exp_dir=$(cd "${EXP_DIR}" && pwd)
    uri="sqlite:///${exp_dir}/mlflow.db"
    extra+=("hydra.sweep.dir=${exp_dir}/${name}/multirun/\${now:%Y-%m-%d_%H-%M-%S}" "tracking.uri=${uri}")
  fi
}
