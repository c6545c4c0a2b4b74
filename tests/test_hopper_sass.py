"""benchmarks.profilers.hopper_sass: the SASS listing is read back into instructions, the main loop found, and its
segments counted; with ptxas and cuobjdump on the machine, a rung compiles for sm_90a without a GPU."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from benchmarks.profilers import hopper_sass

LISTING = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   S2R R0, SR_TID.X ;
        /*0020*/               @P0 BRA 0x50 ;
        /*0030*/                   ISETP.GE.AND P0, PT, R0, 0x10, PT ;
        /*0040*/                   BRA 0x10 ;
        /*0050*/                   WARPGROUP.ARRIVE ;
        /*0060*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], RZ, !UPT ;
        /*0070*/                   FMNMX R18, R24, -INF , !PT ;
        /*0080*/              @!P1 IMAD.MOV.U32 R2, RZ, RZ, R3 ;
        /*0090*/                   FMNMX R19, R25, R18, !PT ;
        /*00a0*/               @P2 BRA 0x50 ;
        /*00b0*/                   EXIT ;
"""


def test_the_listing_is_read_instruction_by_instruction():
    found = hopper_sass.instructions(LISTING)
    assert [a for a, _ in found] == list(range(0, 0xc0, 0x10))
    assert found[8] == (0x80, "@!P1 IMAD.MOV.U32 R2, RZ, RZ, R3")
    assert [hopper_sass.opcode(t) for _, t in found[6:9]] == ["HGMMA", "FMNMX", "IMAD"]


def test_the_main_loop_is_the_backward_branch_around_the_most_hgmmas():
    body = hopper_sass.main_loop(hopper_sass.instructions(LISTING))
    # the loop 0x10-0x40 has no HGMMA; 0x50-0xa0 has
    assert (body[0][0], body[-1][0]) == (0x50, 0xa0)
    lines = hopper_sass.segments(body)
    assert lines[0].split()[1:] == ["WARPGROUP.ARRIVE"]
    assert lines[2].split()[:5] == ["[", "3]", "FMNMX", "2", "IMAD"]
    assert lines[-1].split()[1:3] == ["@P2", "BRA"]


def test_the_registers_after_setmaxnreg_are_read_from_the_listing():
    listing = hopper_sass.instructions("""
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   IMAD R250, R1, R2, RZ ;
        /*0020*/                   USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xf0 ;
        /*0030*/                   FFMA R200, R12, R13, R199 ;
        /*0040*/                   STS [R3+0x10], R201 ;
    """)
    assert hopper_sass.highest_register_after_setmaxnreg(listing) == 201
    assert hopper_sass.highest_register_after_setmaxnreg(hopper_sass.instructions(LISTING)) is None


@pytest.mark.skipif(any(shutil.which(t) is None for t in ("ptxas", "cuobjdump", "nvdisasm")),
                    reason="needs ptxas, cuobjdump and nvdisasm on PATH")
def test_a_rung_compiles_for_sm90a_without_a_gpu():
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    out = subprocess.run([sys.executable, "-m", "benchmarks.profilers.hopper_sass", "h1", "--d", "64"], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "registers" in out.stdout and "HGMMA" in out.stdout
