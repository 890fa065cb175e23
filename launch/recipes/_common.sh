# Shared by the recipe scripts: maps the seed document's environment variables to relax-train overrides.
#   MODEL_DIR   weights are read from $MODEL_DIR/<model name> (MODEL_PATH=... sets model.path exactly)
#   DATA_DIR    datasets (GSM8K: $DATA_DIR/gsm8k); RLOO_DATA_CACHE_DIR: where prepared data is cached
#   EXP_DIR     everything the run writes: relax-train runs in EXP_DIR (as relax-submit --exp-dir runs it), so its
#               checkpoints go to $EXP_DIR/checkpoints/<experiment>/<run name> (relax-train's default, relative to
#               where it runs); the run and sweep directories under $EXP_DIR/<recipe>/, the MLflow store
#               $EXP_DIR/mlflow.db and the sweep scripts' compare/. The directories of the variables above are made
#               absolute first; a relative path in an argument is read from EXP_DIR.
#   ADVANTAGE_ESTIMATOR  algorithm=<it>, e.g. grpo for the control arm of the same recipe and seed
#   SEED        seed=<it>
# Any argument is passed on as an override: bash launch/recipes/<recipe>.sh train.num_rollout=10 dry_run=true
# An argument that sets a key EXP_DIR sets (tracking.uri, hydra.run.dir, hydra.sweep.dir) replaces it; one that
# repeats ADVANTAGE_ESTIMATOR's, SEED's or MODEL_PATH's key is refused by relax-train as a key given twice.

# Whether the arguments after KEY set KEY (KEY=..., +KEY=..., ++KEY=...).
_given() {
  local key=$1 arg
  shift
  for arg in "$@"; do
    arg=${arg#+}
    arg=${arg#+}
    if [[ "${arg}" == "${key}="* ]]; then return 0; fi
  done
  return 1
}

# The environment's directories made absolute (against the current directory), for a relax-train that runs in
# EXP_DIR: a relative one would name a directory there.
_absolute_env() {
  local name value
  for name in MODEL_DIR DATA_DIR MODEL_PATH RLOO_DATA_CACHE_DIR RELAX_MODEL_CACHE_DIR RELAX_TOKENIZER_CACHE_DIR \
              HF_HOME; do
    value=${!name:-}
    if [[ -n "${value}" && "${value}" != /* ]]; then export "${name}=${PWD}/${value}"; fi
  done
  # PYTHONPATH's relative entries too (PYTHONPATH=. is how a project's reward, environment or plugin modules become
  # importable to relax-train, whose console script does not put its directory on sys.path)
  if [[ -n "${PYTHONPATH:-}" ]]; then
    local entry entries=()
    IFS=: read -r -a entries <<< "${PYTHONPATH}"
    value=""
    for entry in "${entries[@]}"; do
      if [[ -z "${entry}" || "${entry}" == "." ]]; then entry=${PWD}; elif [[ "${entry}" != /* ]]; then entry=${PWD}/${entry}; fi
      value=${value:+${value}:}${entry}
    done
    export PYTHONPATH="${value}"
  fi
}

# For the sweep scripts: `own`, the script's own overrides (the arguments before --) less those whose key the
# arguments after -- set: the caller's value is the one relax-train gets (relax-train refuses a key given twice).
own_overrides() {
  own=()
  local pairs=() pair
  while [[ $# -gt 0 && "$1" != "--" ]]; do pairs+=("$1"); shift; done
  if [[ $# -gt 0 ]]; then shift; fi
  for pair in "${pairs[@]}"; do
    _given "${pair%%=*}" "$@" || own+=("${pair}")
  done
}

run_recipe() {
  local name=$1
  shift
  local args=("+experiment=${name}") exp_dir=""
  if [[ -n "${EXP_DIR:-}" ]]; then
    mkdir -p "${EXP_DIR}"
    exp_dir=$(cd "${EXP_DIR}" && pwd)
    _absolute_env
  fi
  if [[ -n "${ADVANTAGE_ESTIMATOR:-}" ]]; then args+=("algorithm=${ADVANTAGE_ESTIMATOR}"); fi
  if [[ -n "${MODEL_PATH:-}" ]]; then args+=("model.path=${MODEL_PATH}"); fi
  if [[ -n "${SEED:-}" ]]; then args+=("seed=${SEED}"); fi
  if [[ -n "${exp_dir}" ]]; then
    _given hydra.run.dir "$@" || args+=("hydra.run.dir=${exp_dir}/${name}/\${now:%Y-%m-%d_%H-%M-%S}")
    _given hydra.sweep.dir "$@" || args+=("hydra.sweep.dir=${exp_dir}/${name}/multirun/\${now:%Y-%m-%d_%H-%M-%S}")
    _given tracking.uri "$@" || args+=("tracking.uri=sqlite:///${exp_dir}/mlflow.db")
    export RELAX_PROJECT_DIR="${RELAX_PROJECT_DIR:-${PWD}}"  # the project's git state, recorded as the run's tags
    cd "${exp_dir}"  # the checkpoints (and any other relative output) under EXP_DIR
    echo "+ cd ${exp_dir}" >&2
  fi
  echo "+ relax-train ${args[*]} $*" >&2
  exec relax-train "${args[@]}" "$@"
}

# For the sweep scripts: sets `uri` (the MLflow store), `extra` (sweep directory and store overrides, less those the
# arguments after NAME set) and `records_dir` (where relax-train and the comparison run: run_train, run_compare) from
# EXP_DIR (default: the current directory holds them all).
sweep_dirs() {
  local name=$1
  shift
  uri="sqlite:///mlflow.db"
  extra=()
  records_dir="."
  if [[ -n "${EXP_DIR:-}" ]]; then
    mkdir -p "${EXP_DIR}"
    local exp_dir
    exp_dir=$(cd "${EXP_DIR}" && pwd)
    _absolute_env
    uri="sqlite:///${exp_dir}/mlflow.db"
    records_dir="${exp_dir}"
    _given hydra.sweep.dir "$@" || extra+=("hydra.sweep.dir=${exp_dir}/${name}/multirun/\${now:%Y-%m-%d_%H-%M-%S}")
    _given tracking.uri "$@" || extra+=("tracking.uri=${uri}")
  fi
}

# relax-train run in `records_dir` (sweep_dirs): its checkpoints (checkpoints/<experiment>/<run name> of each job)
# go under EXP_DIR when it is set. Arguments are relax-train's.
run_train() {
  (export RELAX_PROJECT_DIR="${RELAX_PROJECT_DIR:-${PWD}}" && cd "${records_dir}" && relax-train "$@")
}

# relax-compare of the sweep's store (`uri`), run in `records_dir` (sweep_dirs): its compare/<sweep id or time>/
# goes under EXP_DIR when it is set. Arguments are relax-compare's.
run_compare() {
  (cd "${records_dir}" && relax-compare --uri "${uri}" "$@")
}
