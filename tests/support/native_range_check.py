"""One process, no mpirun: harmpi's native part under the torch of the Python
that runs this file (tests/test_native_torch_range.py runs it in each
declared torch's venv, with a copy of harmpi on PYTHONPATH whose harmpi._C
that venv's torch built). Prints one JSON line of what it saw.

At one rank a sum is the tensor itself, so every call below must leave
``x`` holding 1..1000 in bf16; ``harmpi.info()["native"]`` says whether the
module served the call.
"""

import json

import torch
import torch.distributed as dist

import harmpi
import harmpi.distributed  # noqa: F401 - registers backend "harmpi"
from harmpi import native

x = torch.arange(1, 1001, dtype=torch.bfloat16)
want = x.clone()
seen = {"torch": torch.__version__, "harmpi": harmpi.__file__,
        "loaded": native.load() is not None, "status": native.status()}
module = native._module_file()
seen["built_against"] = native.built_against(module) if module else None

harmpi.allreduce(x)
seen["info_native"] = harmpi.info()["native"]
seen["allreduce"] = torch.equal(x, want)
if seen["loaded"]:
    seen["inplace_op_returns_x"] = torch.ops.harmpi.all_reduce_(x) is x
    y = torch.ops.harmpi.all_reduce(x)
    seen["ops"] = torch.equal(x, want) and torch.equal(y, want) and y is not x

# the backend's default group: the module's allreduce_sum reads the options
# (torch 2.6 and 2.7 have no asyncOp in them)
dist.init_process_group("harmpi", init_method="mpi://")
dist.all_reduce(x)
dist.all_reduce(x, async_op=True).wait()
seen["dist"] = torch.equal(x, want)
dist.destroy_process_group()
print(json.dumps(seen))
