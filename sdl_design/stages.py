"""The release stages in release order: the one list a new stage joins."""

from __future__ import annotations

from sdl_design.assess import AssessStage
from sdl_design.massc.stage import MasscStage
from sdl_design.prb import PrbStage
from sdl_design.pseudo import PseudoDesignStage
from sdl_design.risk import RiskStage
from sdl_design.swap import SwapStage
from sdl_design.topcode import TopcodeStage
from sdl_design.utility import FinalStage

RELEASE_STAGES = [
    RiskStage,
    SwapStage,
    PrbStage,
    MasscStage,
    TopcodeStage,
    PseudoDesignStage,  # a design for the public file when no earlier stage masked it
    FinalStage,
    AssessStage,
]
