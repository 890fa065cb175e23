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

# For the sweep scripts: sets `uri` (the MLflow store; an argument that sets tracking.uri names it), `extra` (sweep
# directory and store overrides, less those the arguments after NAME set) and `records_dir` (where relax-train and
# the comparison run: run_train, run_compare) from EXP_DIR (default: the current directory holds them all).
sweep_dirs() {
  local name=$1
  shift
  uri="sqlite:///mlflow.db"
  extra=()
  records_dir="."
  sweep_rc=0 sweep_ids=() sweep_runs=()  # run_sweep's
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
  uri_from_arguments "$@"
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

# For the sweep scripts: the store the sweep writes to, `uri`, from the arguments (the caller's, as relax-train
# gets them): one that sets tracking.uri replaces sweep_dirs' (its quotes removed). Empty: tracking is off (also
# tracking.enabled=false).
uri_from_arguments() {
  local arg value
  for arg in "$@"; do
    arg=${arg#+}
    arg=${arg#+}
    case "${arg,,}" in tracking.enabled=false | tracking.enabled=no | tracking.enabled=off | tracking.enabled=0)
      uri=""; return 0 ;;
    esac
    if [[ "${arg}" == tracking.uri=* ]]; then
      value=${arg#tracking.uri=}
      value=${value#[\"\']}
      value=${value%[\"\']}
      case "${value}" in null | None | "~") value="" ;; esac
      uri=${value}
    fi
  done
}

# Whether the arguments ask for a dry run (dry_run=true, yes, on or 1, as OmegaConf reads a boolean).
_dry_run() {
  local arg
  for arg in "$@"; do
    arg=${arg#+}
    arg=${arg#+}
    case "${arg,,}" in dry_run=true | dry_run=yes | dry_run=on | dry_run=1) return 0 ;; esac
  done
  return 1
}

# For the sweep scripts: run_train with its output shown and read. Sets `sweep_rc`, the worst of relax-train's
# exit codes so far (0 all finished, 1 some job failed, 2 nothing started, 130/143 interrupted), and appends to
# `sweep_ids` the id the launcher's first line names (`Sweep <id>: <n> jobs`; a sweep that started nothing, or a dry
# run, prints none) and to `sweep_runs` the MLflow run ids of its jobs (the `mlflow run` column of the table it ends
# with). The output goes through tee, which ignores Ctrl-C and SIGTERM so that the launcher's last lines (the jobs
# stopping, the table) still reach the terminal.
run_sweep() {
  { local log id run rc flags=$-; set +x; } 2>/dev/null
  log=$(mktemp)
  set +e
  if [[ "${flags}" == *x* ]]; then set -x; fi
  PYTHONUNBUFFERED=1 run_train "$@" | (trap '' INT TERM && exec tee "${log}")  # its output as it comes, piped too
  { rc=${PIPESTATUS[0]}; set +x; } 2>/dev/null
  set -e
  if (( rc > sweep_rc )); then sweep_rc=${rc}; fi
  id=$(sed -n -E 's/^Sweep ([^ :]+): [0-9]+ jobs(,.*)?$/\1/p' "${log}" | head -n 1)
  if [[ -n "${id}" ]]; then
    sweep_ids+=("${id}")
    # the table's rows, `<index>  <overrides>  <status>  <time>  <run id>  <reward>`, after its title line
    while read -r run; do sweep_runs+=("${run}"); done < <(awk -v title="Sweep ${id}: " '
      index($0, title) == 1 && / jobs finished/ { table = 1; next }
      table && /^[0-9]+ / { for (i = 2; i <= NF; i++) if (length($i) == 32 && $i ~ /^[0-9a-f]+$/) print $i }' "${log}")
  fi
  rm -f "${log}"
  if [[ "${flags}" == *x* ]]; then set -x; fi
}

# For the sweep scripts, between two sweeps: exits with relax-train's exit code where it is neither 0 nor 1 (2:
# nothing started, 130 or 143: interrupted), as stop_unless_comparable does.
stop_if_not_run() {
  { local flags=$-; set +x; } 2>/dev/null
  if [[ "${sweep_rc}" != 0 && "${sweep_rc}" != 1 ]]; then
    echo "relax-train exited ${sweep_rc}: no comparison" >&2
    exit "${sweep_rc}"
  fi
  if [[ "${flags}" == *x* ]]; then set -x; fi
}

# For the sweep scripts, after the last run_sweep: exits where there is nothing to compare, with relax-train's exit
# code: 2 (nothing started), 130, 143 (interrupted; any code but 0 and 1), 0 after a dry run (among the arguments,
# the script's), 1 where no sweep started otherwise; and where tracking.uri is off. Returns where the jobs ran, all
# (sweep_rc 0) or some (1: what finished is compared; the script then exits 1).
stop_unless_comparable() {
  { local flags=$-; set +x; } 2>/dev/null
  stop_if_not_run
  if (( ${#sweep_ids[@]} == 0 )); then
    if [[ "${sweep_rc}" == 0 ]] && _dry_run "$@"; then exit 0; fi
    echo "relax-train started no sweep (no 'Sweep <id>: <n> jobs' line): no comparison" >&2
    exit $(( sweep_rc == 0 ? 1 : sweep_rc ))
  fi
  if [[ -z "${uri}" ]]; then
    echo "tracking.uri is off: the sweep logged nothing to compare" >&2
    exit "${sweep_rc}"
  fi
  if [[ "${flags}" == *x* ]]; then set -x; fi
}
