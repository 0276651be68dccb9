"""Tests for zerotrain.optim.schedulers: DeepSpeed's LR schedules, step for step."""

from __future__ import annotations

import io
import math
from typing import Any

import pytest
import torch
from torch.optim.lr_scheduler import LRScheduler

from zerotrain.optim import OneCycle, WarmupCosineLR, WarmupLR, build_scheduler

NUM_STEPS = 50
BASE_LRS = (0.01, 0.003)  # the two param groups' lr when the scheduler is built

# Generated with DeepSpeed 0.19.8 (torch 2.13.0+cpu, DS_ACCELERATOR=cpu): for each
# case, the LR of each param group right after construction and after each of 50 step()s,
# and beta1 for OneCycle with cycle_momentum (beta2 was 0.99 throughout).
_DS_GOLDEN: dict[str, tuple[str, dict[str, Any], list[list[float]], list[float] | None]] = {
    "warmup_log": (
        "WarmupLR",
        {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01, "warmup_num_steps": 10},
        [
            [
                0.0,
                0.0,
                0.0030102999566398113,
                0.004771212547196624,
                0.006020599913279623,
                0.006989700043360187,
                0.007781512503836435,
                0.008450980400142567,
                0.009030899869919434,
                0.009542425094393249,
                0.009999999999999998,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
            ],
        ],
        None,
    ),
    "warmup_linear_lists": (
        "WarmupLR",
        {
            "warmup_min_lr": [0.0001, 0.0002],
            "warmup_max_lr": [0.01, 0.02],
            "warmup_num_steps": 7,
            "warmup_type": "linear",
        },
        [
            [
                0.0001,
                0.0001,
                0.0015142857142857143,
                0.0029285714285714284,
                0.004342857142857143,
                0.005757142857142857,
                0.0071714285714285725,
                0.008585714285714285,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
            ],
            [
                0.0002,
                0.0002,
                0.0030285714285714286,
                0.005857142857142857,
                0.008685714285714286,
                0.011514285714285715,
                0.014342857142857145,
                0.01717142857142857,
                0.02,
                0.02,
                0.02,
                0.02,
                0.02,
                0.02,
                0.02,
                0.02,
                0.02,
                0.02,
                0.02,
                0.02,
                0.02,
                0.02,
                0.02,
                0.02,
                0.02,
                0.02,
                0.02,
                0.02,
                0.02,
                0.02,
                0.02,
                0.02,
                0.02,
                0.02,
                0.02,
                0.02,
                0.02,
                0.02,
                0.02,
                0.02,
                0.02,
                0.02,
                0.02,
                0.02,
                0.02,
                0.02,
                0.02,
                0.02,
                0.02,
                0.02,
                0.02,
            ],
        ],
        None,
    ),
    "warmup_default_max": (
        "WarmupLR",
        {"warmup_num_steps": 5},
        [
            [
                0.0,
                0.0,
                0.00430676558073393,
                0.006826061944859854,
                0.00861353116146786,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
                0.01,
            ],
            [
                0.0,
                0.0,
                0.0012920296742201791,
                0.0020478185834579563,
                0.0025840593484403583,
                0.003,
                0.003,
                0.003,
                0.003,
                0.003,
                0.003,
                0.003,
                0.003,
                0.003,
                0.003,
                0.003,
                0.003,
                0.003,
                0.003,
                0.003,
                0.003,
                0.003,
                0.003,
                0.003,
                0.003,
                0.003,
                0.003,
                0.003,
                0.003,
                0.003,
                0.003,
                0.003,
                0.003,
                0.003,
                0.003,
                0.003,
                0.003,
                0.003,
                0.003,
                0.003,
                0.003,
                0.003,
                0.003,
                0.003,
                0.003,
                0.003,
                0.003,
                0.003,
                0.003,
                0.003,
                0.003,
            ],
        ],
        None,
    ),
    "decay_log": (
        "WarmupDecayLR",
        {
            "total_num_steps": 40,
            "warmup_min_lr": 0.0001,
            "warmup_max_lr": 0.01,
            "warmup_num_steps": 10,
        },
        [
            [
                0.0001,
                0.0001,
                0.0030801969570734135,
                0.004823500421724658,
                0.0060603939141468275,
                0.007019803042926586,
                0.007803697378798072,
                0.008466470596141142,
                0.00904059087122024,
                0.009547000843449316,
                0.009999999999999998,
                0.01,
                0.00967,
                0.009340000000000001,
                0.00901,
                0.00868,
                0.00835,
                0.008020000000000001,
                0.0076900000000000015,
                0.00736,
                0.007030000000000001,
                0.0067,
                0.006370000000000001,
                0.00604,
                0.005710000000000001,
                0.00538,
                0.005050000000000001,
                0.004720000000000001,
                0.004390000000000001,
                0.004060000000000001,
                0.00373,
                0.0034,
                0.00307,
                0.00274,
                0.0024100000000000002,
                0.0020800000000000003,
                0.00175,
                0.00142,
                0.0010900000000000003,
                0.00076,
                0.00043,
                0.0001,
                0.0001,
                0.0001,
                0.0001,
                0.0001,
                0.0001,
                0.0001,
                0.0001,
                0.0001,
                0.0001,
            ],
        ],
        None,
    ),
    "decay_linear": (
        "WarmupDecayLR",
        {"total_num_steps": 30, "warmup_num_steps": 5, "warmup_type": "linear"},
        [
            [
                0.0,
                0.0,
                0.0002,
                0.0004,
                0.0006,
                0.0008,
                0.001,
                0.00096,
                0.00092,
                0.00088,
                0.00084,
                0.0008,
                0.00076,
                0.0007199999999999999,
                0.00068,
                0.00064,
                0.0006,
                0.0005600000000000001,
                0.0005200000000000001,
                0.00048,
                0.00044,
                0.0004,
                0.00035999999999999997,
                0.00032,
                0.00028000000000000003,
                0.00024,
                0.0002,
                0.00016,
                0.00012,
                8e-05,
                4e-05,
                0.0,
                0.0,
                0.0,
                0.0,
                0.0,
                0.0,
                0.0,
                0.0,
                0.0,
                0.0,
                0.0,
                0.0,
                0.0,
                0.0,
                0.0,
                0.0,
                0.0,
                0.0,
                0.0,
                0.0,
            ],
        ],
        None,
    ),
    "cosine_log": (
        "WarmupCosineLR",
        {
            "total_num_steps": 40,
            "warmup_num_steps": 10,
            "warmup_min_ratio": 0.1,
            "cos_min_ratio": 0.05,
        },
        [
            [
                0.0,
                0.001,
                0.003709269960975831,
                0.005294091292476961,
                0.006418539921951661,
                0.007290730039024168,
                0.008003361253452792,
                0.008605882360128311,
                0.00912780988292749,
                0.009588182584953923,
                0.009999999999999998,
                0.009973979002999298,
                0.009896201103485576,
                0.00976751845240198,
                0.009589340923802354,
                0.009363620667976085,
                0.009092830723281,
                0.008779937921017623,
                0.008428370380204577,
                0.008041979948389247,
                0.007625,
                0.007181999054610052,
                0.006717830723281001,
                0.006237580531384356,
                0.0057465102005213545,
                0.00525,
                0.004753489799478646,
                0.004262419468615644,
                0.003782169276719,
                0.0033180009453899497,
                0.002875000000000001,
                0.002458020051610753,
                0.002071629619795425,
                0.0017200620789823767,
                0.0014071692767190004,
                0.0011363793320239163,
                0.0009106590761976455,
                0.0007324815475980209,
                0.000603798896514423,
                0.0005260209970007019,
                0.0005,
                0.0005,
                0.0005,
                0.0005,
                0.0005,
                0.0005,
                0.0005,
                0.0005,
                0.0005,
                0.0005,
                0.0005,
            ],
            [
                0.0,
                0.00030000000000000003,
                0.0011127809882927491,
                0.0015882273877430883,
                0.0019255619765854981,
                0.0021872190117072504,
                0.0024010083760358375,
                0.002581764708038493,
                0.002738342964878247,
                0.0028764547754861767,
                0.0029999999999999996,
                0.0029921937008997894,
                0.002968860331045673,
                0.002930255535720594,
                0.002876802277140706,
                0.0028090862003928253,
                0.0027278492169843,
                0.002633981376305287,
                0.002528511114061373,
                0.0024125939845167743,
                0.0022875,
                0.0021545997163830155,
                0.0020153492169843004,
                0.0018712741594153067,
                0.0017239530601564062,
                0.001575,
                0.0014260469398435938,
                0.001278725840584693,
                0.0011346507830156999,
                0.000995400283616985,
                0.0008625000000000003,
                0.0007374060154832259,
                0.0006214888859386275,
                0.000516018623694713,
                0.00042215078301570006,
                0.00034091379960717483,
                0.00027319772285929367,
                0.00021974446427940625,
                0.0001811396689543269,
                0.00015780629910021058,
                0.00015000000000000001,
                0.00015000000000000001,
                0.00015000000000000001,
                0.00015000000000000001,
                0.00015000000000000001,
                0.00015000000000000001,
                0.00015000000000000001,
                0.00015000000000000001,
                0.00015000000000000001,
                0.00015000000000000001,
                0.00015000000000000001,
            ],
        ],
        None,
    ),
    "cosine_linear": (
        "WarmupCosineLR",
        {"total_num_steps": 30, "warmup_num_steps": 8, "warmup_type": "linear"},
        [
            [
                0.0,
                0.0,
                0.00125,
                0.0025,
                0.00375,
                0.005,
                0.00625,
                0.0075,
                0.00875,
                0.009949112298683723,
                0.00979748512158568,
                0.009548205160774915,
                0.009206347037389491,
                0.008778869996984115,
                0.008274476239359453,
                0.007703433766869261,
                0.007077367357502932,
                0.006409021917928728,
                0.00571200303394729,
                0.0050005,
                0.0042889969660527116,
                0.003591978082071272,
                0.0029236326424970692,
                0.0022975662331307417,
                0.0017265237606405477,
                0.0012221300030158862,
                0.0007946529626105091,
                0.0004527948392250851,
                0.00020351487841432095,
                5.188770131627705e-05,
                1.0000000000000002e-06,
                1.0000000000000002e-06,
                1.0000000000000002e-06,
                1.0000000000000002e-06,
                1.0000000000000002e-06,
                1.0000000000000002e-06,
                1.0000000000000002e-06,
                1.0000000000000002e-06,
                1.0000000000000002e-06,
                1.0000000000000002e-06,
                1.0000000000000002e-06,
                1.0000000000000002e-06,
                1.0000000000000002e-06,
                1.0000000000000002e-06,
                1.0000000000000002e-06,
                1.0000000000000002e-06,
                1.0000000000000002e-06,
                1.0000000000000002e-06,
                1.0000000000000002e-06,
                1.0000000000000002e-06,
                1.0000000000000002e-06,
            ],
            [
                0.0,
                0.0,
                0.000375,
                0.00075,
                0.0011250000000000001,
                0.0015,
                0.001875,
                0.0022500000000000003,
                0.002625,
                0.002984733689605117,
                0.002939245536475704,
                0.0028644615482324746,
                0.0027619041112168473,
                0.0026336609990952344,
                0.002482342871807836,
                0.0023110301300607785,
                0.0021232102072508796,
                0.0019227065753786184,
                0.001713600910184187,
                0.00150015,
                0.0012866990898158133,
                0.0010775934246213816,
                0.0008770897927491209,
                0.0006892698699392225,
                0.0005179571281921643,
                0.0003666390009047659,
                0.00023839588878315273,
                0.00013583845176752554,
                6.105446352429629e-05,
                1.5566310394883115e-05,
                3.0000000000000004e-07,
                3.0000000000000004e-07,
                3.0000000000000004e-07,
                3.0000000000000004e-07,
                3.0000000000000004e-07,
                3.0000000000000004e-07,
                3.0000000000000004e-07,
                3.0000000000000004e-07,
                3.0000000000000004e-07,
                3.0000000000000004e-07,
                3.0000000000000004e-07,
                3.0000000000000004e-07,
                3.0000000000000004e-07,
                3.0000000000000004e-07,
                3.0000000000000004e-07,
                3.0000000000000004e-07,
                3.0000000000000004e-07,
                3.0000000000000004e-07,
                3.0000000000000004e-07,
                3.0000000000000004e-07,
                3.0000000000000004e-07,
            ],
        ],
        None,
    ),
    "onecycle_decay_mom": (
        "OneCycle",
        {
            "cycle_min_lr": 0.0001,
            "cycle_max_lr": 0.01,
            "cycle_first_step_size": 10,
            "cycle_second_step_size": 15,
            "decay_step_size": 5,
            "decay_lr_rate": 0.1,
            "cycle_min_mom": 0.85,
            "cycle_max_mom": 0.95,
            "decay_mom_rate": 0.01,
        },
        [
            [
                0.0001,
                0.001090000000000001,
                0.0020800000000000016,
                0.003070000000000003,
                0.0040599999999999985,
                0.00505,
                0.00604,
                0.0070300000000000015,
                0.008020000000000001,
                0.009009999999999997,
                0.009999999999999998,
                0.009340000000000001,
                0.00868,
                0.008020000000000001,
                0.00736,
                0.006699999999999999,
                0.006039999999999999,
                0.0053799999999999985,
                0.004720000000000001,
                0.004060000000000001,
                0.0033999999999999994,
                0.002740000000000003,
                0.0020800000000000016,
                0.0014200000000000016,
                0.0007600000000000008,
                0.0001,
                9.803921568627452e-05,
                9.615384615384615e-05,
                9.433962264150943e-05,
                9.259259259259259e-05,
                9.09090909090909e-05,
                8.928571428571429e-05,
                8.771929824561404e-05,
                8.620689655172413e-05,
                8.474576271186441e-05,
                8.333333333333334e-05,
                8.19672131147541e-05,
                8.064516129032258e-05,
                7.936507936507937e-05,
                7.8125e-05,
                7.692307692307693e-05,
                7.575757575757576e-05,
                7.462686567164179e-05,
                7.352941176470588e-05,
                7.246376811594204e-05,
                7.142857142857143e-05,
                7.042253521126761e-05,
                6.944444444444444e-05,
                6.849315068493152e-05,
                6.756756756756757e-05,
                6.666666666666667e-05,
            ],
        ],
        [
            0.85,
            0.94,
            0.9299999999999999,
            0.9199999999999999,
            0.91,
            0.9,
            0.89,
            0.88,
            0.87,
            0.86,
            0.85,
            0.8566666666666667,
            0.8633333333333333,
            0.87,
            0.8766666666666667,
            0.8833333333333333,
            0.89,
            0.8966666666666666,
            0.9033333333333333,
            0.9099999999999999,
            0.9166666666666666,
            0.9233333333333332,
            0.9299999999999999,
            0.9366666666666666,
            0.9433333333333332,
            0.95,
            0.9519,
            0.9538,
            0.9557,
            0.9576,
            0.9594999999999999,
            0.9613999999999999,
            0.9632999999999999,
            0.9652,
            0.9671,
            0.969,
            0.9709,
            0.9728,
            0.9747,
            0.9766,
            0.9784999999999999,
            0.9803999999999999,
            0.9823,
            0.9842,
            0.9861,
            0.988,
            0.9899,
            0.9918,
            0.9937,
            0.9956,
            0.9974999999999999,
        ],
    ),
    "onecycle_stairs": (
        "OneCycle",
        {
            "cycle_min_lr": 0.001,
            "cycle_max_lr": 0.005,
            "cycle_first_step_size": 12,
            "cycle_first_stair_count": 4,
            "cycle_second_step_size": 8,
            "cycle_second_stair_count": 2,
        },
        [
            [
                0.001,
                0.001,
                0.001,
                0.002,
                0.002,
                0.002,
                0.003,
                0.003,
                0.003,
                0.004,
                0.004,
                0.004,
                0.005,
                0.003,
                0.003,
                0.003,
                0.003,
                0.001,
                0.001,
                0.001,
                0.001,
                0.001,
                0.001,
                0.001,
                0.001,
                0.001,
                0.001,
                0.001,
                0.001,
                0.001,
                0.001,
                0.001,
                0.001,
                0.001,
                0.001,
                0.001,
                0.001,
                0.001,
                0.001,
                0.001,
                0.001,
                0.001,
                0.001,
                0.001,
                0.001,
                0.001,
                0.001,
                0.001,
                0.001,
                0.001,
                0.001,
            ],
        ],
        [
            0.8,
            0.9,
            0.9,
            0.875,
            0.875,
            0.875,
            0.8500000000000001,
            0.8500000000000001,
            0.8500000000000001,
            0.8250000000000001,
            0.8250000000000001,
            0.8250000000000001,
            0.8,
            0.8500000000000001,
            0.8500000000000001,
            0.8500000000000001,
            0.8500000000000001,
            0.9,
            0.9,
            0.9,
            0.9,
            0.9,
            0.9,
            0.9,
            0.9,
            0.9,
            0.9,
            0.9,
            0.9,
            0.9,
            0.9,
            0.9,
            0.9,
            0.9,
            0.9,
            0.9,
            0.9,
            0.9,
            0.9,
            0.9,
            0.9,
            0.9,
            0.9,
            0.9,
            0.9,
            0.9,
            0.9,
            0.9,
            0.9,
            0.9,
            0.9,
        ],
    ),
    "onecycle_plain_nomom": (
        "OneCycle",
        {
            "cycle_min_lr": 0.002,
            "cycle_max_lr": 0.02,
            "cycle_first_step_size": 6,
            "cycle_momentum": False,
        },
        [
            [
                0.002,
                0.0049999999999999975,
                0.008000000000000004,
                0.011000000000000001,
                0.013999999999999999,
                0.017000000000000005,
                0.020000000000000004,
                0.016999999999999994,
                0.014000000000000007,
                0.011000000000000001,
                0.007999999999999997,
                0.005000000000000006,
                0.002,
                0.002,
                0.002,
                0.002,
                0.002,
                0.002,
                0.002,
                0.002,
                0.002,
                0.002,
                0.002,
                0.002,
                0.002,
                0.002,
                0.002,
                0.002,
                0.002,
                0.002,
                0.002,
                0.002,
                0.002,
                0.002,
                0.002,
                0.002,
                0.002,
                0.002,
                0.002,
                0.002,
                0.002,
                0.002,
                0.002,
                0.002,
                0.002,
                0.002,
                0.002,
                0.002,
                0.002,
                0.002,
                0.002,
            ],
        ],
        None,
    ),
}


def _optimizer(cls: type[torch.optim.Optimizer] = torch.optim.AdamW) -> torch.optim.Optimizer:
    groups = [
        {"params": [torch.nn.Parameter(torch.zeros(3))]},
        {"params": [torch.nn.Parameter(torch.zeros(2))], "lr": BASE_LRS[1]},
    ]
    return cls(groups, lr=BASE_LRS[0])


def _observe(opt: torch.optim.Optimizer) -> tuple[list[float], list[tuple[float, float]]]:
    return (
        [float(g["lr"]) for g in opt.param_groups],
        [tuple(g["betas"]) for g in opt.param_groups],
    )


def _trace(
    opt: torch.optim.Optimizer, sched: LRScheduler, num_steps: int
) -> tuple[list[list[float]], list[list[tuple[float, float]]]]:
    """LRs and betas after construction and after each step, stepping as the engine does."""
    lrs, betas = [], []
    for i in range(num_steps + 1):
        if i:
            opt.step()  # no gradients: a no-op, but the order torch expects
            sched.step()
        lr, beta = _observe(opt)
        lrs.append(lr)
        betas.append(beta)
    return lrs, betas


def _golden_per_group(case: str) -> list[list[float]]:
    """Golden LRs indexed [step][group]; a single golden list means both groups agree."""
    columns = _DS_GOLDEN[case][2]
    if len(columns) == 1:
        columns = columns * 2
    return [list(row) for row in zip(*columns, strict=True)]


def _assert_close(got: list[float], want: list[float]) -> None:
    assert got == pytest.approx(want, rel=1e-12, abs=1e-18)


# ---------------------------------------------------------------------------------------------
# The DeepSpeed formulas, written out independently of the implementation.


def _warmup_gamma(it: int, params: dict[str, Any]) -> float | None:
    """Fraction of warmup done at iteration ``it``, or None once warmup is over."""
    warmup = max(2, params.get("warmup_num_steps", 1000))
    if it >= warmup:
        return None
    if params.get("warmup_type", "log") == "linear":
        return it / warmup
    return math.log(it + 1) / math.log(warmup)


def _formula_lrs(sched_type: str, params: dict[str, Any], it: int) -> list[float]:
    def per_group(value: Any) -> list[float]:
        return list(value) if isinstance(value, (list, tuple)) else [value, value]

    if sched_type in ("WarmupLR", "WarmupDecayLR"):
        lo = per_group(params.get("warmup_min_lr", 0.0))
        default_hi = list(BASE_LRS) if sched_type == "WarmupLR" else 0.001
        hi = per_group(params.get("warmup_max_lr", default_hi))
        if it < 0:
            return lo
        gamma = _warmup_gamma(it, params)
        if gamma is None:
            if sched_type == "WarmupLR":
                gamma = 1.0
            else:
                total, warmup = params["total_num_steps"], max(2, params["warmup_num_steps"])
                gamma = max(0.0, (total - it) / max(1, total - warmup))
        return [a + (b - a) * gamma for a, b in zip(lo, hi, strict=True)]

    if sched_type == "WarmupCosineLR":
        if it < 0:
            return [0.0, 0.0]
        gamma = _warmup_gamma(it, params)
        if gamma is not None:
            start = params.get("warmup_min_ratio", 0.0)
            ratio = start + (1 - start) * gamma
        else:
            warmup = max(2, params.get("warmup_num_steps", 1000))
            progress = min(1.0, (it - warmup + 1) / max(1, params["total_num_steps"] - warmup))
            floor = params.get("cos_min_ratio", 0.0001)
            ratio = max(0.0, floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))
        return [base * ratio for base in BASE_LRS]

    assert sched_type == "OneCycle"
    lo, hi = params["cycle_min_lr"], params["cycle_max_lr"]
    scale = _onecycle_scale(params, it)
    if scale is not None:
        return [lo + (hi - lo) * scale] * 2
    rate, interval = params.get("decay_lr_rate", 0.0), params.get("decay_step_size", 0)
    if rate == 0 or interval == 0:
        return [lo, lo]
    return [lo / (1 + rate * (it - _cycle_length(params) + 1) / interval)] * 2


def _formula_beta1(params: dict[str, Any], it: int) -> float:
    lo, hi = params.get("cycle_min_mom", 0.8), params.get("cycle_max_mom", 0.9)
    if it < 0:
        return lo
    scale = _onecycle_scale(params, it)
    if scale is not None:
        return hi - (hi - lo) * scale
    rate, interval = params.get("decay_mom_rate", 0.0), params.get("decay_step_size", 0)
    if rate == 0 or interval == 0:
        return hi
    return hi * (1 + rate * (it - _cycle_length(params) + 1) / interval)


def _cycle_length(params: dict[str, Any]) -> int:
    first = params.get("cycle_first_step_size", 2000)
    second = params.get("cycle_second_step_size") or first
    return first + second


def _onecycle_scale(params: dict[str, Any], it: int) -> float | None:
    """Height in the cycle, 0 at the ends and 1 at the peak; None after the cycle."""
    first = params.get("cycle_first_step_size", 2000)
    second = params.get("cycle_second_step_size") or first
    if it < 0:
        return 0.0
    if it >= first + second:
        return None
    pos = it + 1  # DeepSpeed measures the cycle from the batch being started
    rising = pos <= first
    stairs = params.get("cycle_first_stair_count", 0)
    if not rising:
        stairs = params.get("cycle_second_stair_count") or stairs
    height = pos / first if rising else (first + second - pos) / second
    if stairs:
        span = first if rising else second
        steps_in = pos if rising else first + second - pos
        height = math.floor(steps_in * stairs / span) / stairs
    return height


# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", sorted(_DS_GOLDEN))
def test_matches_deepspeed_golden(case: str) -> None:
    sched_type, params, _, golden_beta1 = _DS_GOLDEN[case]
    opt = _optimizer()
    sched = build_scheduler(sched_type, params, opt)
    lrs, betas = _trace(opt, sched, NUM_STEPS)
    for got, want in zip(lrs, _golden_per_group(case), strict=True):
        _assert_close(got, want)
    if golden_beta1 is not None:
        for got, want in zip(betas, golden_beta1, strict=True):
            assert got == [(pytest.approx(want, rel=1e-12), 0.99)] * 2
    else:
        assert all(b == [(0.9, 0.999)] * 2 for b in betas)


@pytest.mark.parametrize("case", sorted(_DS_GOLDEN))
def test_matches_documented_formulas(case: str) -> None:
    sched_type, params, _, golden_beta1 = _DS_GOLDEN[case]
    opt = _optimizer()
    sched = build_scheduler(sched_type, params, opt)
    lrs, betas = _trace(opt, sched, NUM_STEPS)
    for i, (got, beta) in enumerate(zip(lrs, betas, strict=True)):
        _assert_close(got, _formula_lrs(sched_type, params, i - 1))
        if golden_beta1 is not None:
            assert beta[0][0] == pytest.approx(_formula_beta1(params, i - 1), rel=1e-12)


@pytest.mark.parametrize("case", sorted(_DS_GOLDEN))
def test_state_dict_round_trip_resumes_the_sequence(case: str) -> None:
    sched_type, params, _, _ = _DS_GOLDEN[case]
    opt = _optimizer()
    sched = build_scheduler(sched_type, params, opt)
    full_lrs, full_betas = _trace(opt, sched, NUM_STEPS)

    opt = _optimizer()
    sched = build_scheduler(sched_type, params, opt)
    _trace(opt, sched, 20)
    buffer = io.BytesIO()
    torch.save({"optimizer": opt.state_dict(), "scheduler": sched.state_dict()}, buffer)
    buffer.seek(0)
    checkpoint = torch.load(buffer)  # weights_only: the state holds plain data only

    opt = _optimizer()
    sched = build_scheduler(sched_type, params, opt)
    opt.load_state_dict(checkpoint["optimizer"])
    sched.load_state_dict(checkpoint["scheduler"])
    assert sched.last_batch_iteration == 19
    lrs, betas = _trace(opt, sched, NUM_STEPS - 20)
    assert lrs == full_lrs[20:]
    assert betas == full_betas[20:]


def test_loads_a_deepspeed_state_dict_and_jumps() -> None:
    sched_type, params, _, _ = _DS_GOLDEN["decay_log"]
    golden = _golden_per_group("decay_log")
    opt = _optimizer()
    sched = build_scheduler(sched_type, params, opt)
    sched.load_state_dict({"last_batch_iteration": 19})  # all a DeepSpeed checkpoint holds
    opt.step()
    sched.step()
    _assert_close(sched.get_last_lr(), golden[21])
    sched.step(33)  # DeepSpeed's step(last_batch_iteration)
    _assert_close(sched.get_last_lr(), golden[34])
    assert sched.state_dict()["last_batch_iteration"] == 33


def test_schedulers_are_torch_lr_schedulers() -> None:
    opt = _optimizer()
    sched = build_scheduler("WarmupLR", {"warmup_num_steps": 5}, opt)
    assert isinstance(sched, LRScheduler)
    assert isinstance(sched, WarmupLR)
    opt.step()
    sched.step()
    assert sched.get_last_lr() == [g["lr"] for g in opt.param_groups]


def test_resume_with_last_batch_iteration_argument() -> None:
    golden = _golden_per_group("cosine_log")
    _, params, _, _ = _DS_GOLDEN["cosine_log"]
    opt = _optimizer()
    sched = WarmupCosineLR(opt, **params, last_batch_iteration=12)
    assert sched.last_batch_iteration == 12
    _assert_close(_observe(opt)[0], golden[13])


def test_onecycle_leaves_sgd_momentum_alone_like_deepspeed() -> None:
    opt = _optimizer(lambda groups, lr: torch.optim.SGD(groups, lr=lr, momentum=0.9))  # type: ignore[arg-type]
    with pytest.warns(UserWarning, match="cycle_momentum is disabled"):
        sched = OneCycle(opt, cycle_min_lr=0.001, cycle_max_lr=0.01, cycle_first_step_size=4)
    for _ in range(6):
        opt.step()
        sched.step()
        assert [g["momentum"] for g in opt.param_groups] == [0.9, 0.9]
    assert not sched.cycle_momentum


def test_unknown_warmup_type_falls_back_to_log() -> None:
    opt = _optimizer()
    with pytest.warns(UserWarning, match="warmup_type"):
        sched = WarmupLR(opt, warmup_max_lr=0.01, warmup_num_steps=10, warmup_type="cubic")
    assert sched.warmup_type == "log"


@pytest.mark.parametrize(
    ("sched_type", "params", "match"),
    [
        ("CosineAnnealingLR", {}, r"scheduler\.type"),
        ("WarmupLR", {"warmup_steps": 10}, r"scheduler\.params\.warmup_steps"),
        ("WarmupDecayLR", {"warmup_num_steps": 10}, r"scheduler\.params\.total_num_steps"),
        ("WarmupCosineLR", {}, r"scheduler\.params\.total_num_steps"),
        ("OneCycle", {"cycle_max_lr": 0.1}, r"scheduler\.params\.cycle_min_lr"),
        ("WarmupLR", {"warmup_num_steps": 0}, "positive integer, got 0; .* give 1"),
        ("WarmupLR", {"warmup_max_lr": [0.1, 0.2, 0.3]}, "one value per param group"),
        (
            "OneCycle",
            {"cycle_min_lr": 0.1, "cycle_max_lr": 1, "cycle_first_step_size": 0},
            "positive",
        ),
    ],
)
def test_build_scheduler_rejects(sched_type: str, params: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build_scheduler(sched_type, params, _optimizer())


@pytest.mark.parametrize("sched_type", ["WarmupDecayLR", "WarmupCosineLR"])
def test_total_shorter_than_warmup_warns_and_runs(sched_type: str) -> None:
    opt = _optimizer()
    with pytest.warns(UserWarning, match="total_num_steps 5 is less than warmup_num_steps 10"):
        sched = build_scheduler(sched_type, {"total_num_steps": 5, "warmup_num_steps": 10}, opt)
    lrs, _ = _trace(opt, sched, 12)
    for i, lr in enumerate(lrs):
        _assert_close(
            lr, _formula_lrs(sched_type, {"total_num_steps": 5, "warmup_num_steps": 10}, i - 1)
        )
