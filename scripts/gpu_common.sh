# Sourced by the scripts that run on a lent GPU (gpu_map.sh, gpu_scale.sh): the Python path (the
# wheels carried in .whl installed beside the checkout), the GPU and torch named in the log, and
# CUDA MPS, so that many small units' kernels run side by side instead of in turns.
#   gpu_python            PYTHONPATH and the carried wheels
#   gpu_mps_start         starts MPS when the driver has it (sets $mps); gpu_mps_stop stops it
gpu_python() {
  if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD
  else
    export PYTHONPATH=$PWD
  fi
  export PYTHONUNBUFFERED=1
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, sklearn, scipy; print('torch', torch.__version__, 'sklearn', sklearn.__version__, 'scipy', scipy.__version__, 'cuda', torch.cuda.is_available())"
}

gpu_mps_start() {
  mps=""
  command -v nvidia-cuda-mps-control >/dev/null || return 0
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
  mkdir -p /tmp/mps-pipe /tmp/mps-log
  if nvidia-cuda-mps-control -d && timeout 60 python3 -c "import torch; torch.ones(1, device='cuda').sum().item()"; then
    mps=1; echo "CUDA MPS on"
  else
    echo quit | nvidia-cuda-mps-control 2>/dev/null; unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
    echo "CUDA MPS did not start: units take turns on the GPU"
  fi
}

gpu_mps_stop() {  # bounded: the daemon waits for its clients, and a worker left behind would hold the call
  pkill -9 -f "multiprocessing.spawn" 2>/dev/null
  [ -n "${mps:-}" ] && { echo quit | timeout 20 nvidia-cuda-mps-control || echo "MPS did not stop within 20 s"; }
  return 0
}
