"""Sidecar injection: the settings (`config`), the pure patch builder (`patch`) with how vLLM's
command line is reached (`vllm_launch`) and what injected containers may use (`resources`), the
validated model of what it reads in a Pod (`pod`), the AdmissionReview codec (`review`);
`refit_operator.webhook` serves them over HTTPS."""

from refit_operator.injection.config import (
    InjectionConfig,
    InjectionConfigError,
    load_injection_config,
)
from refit_operator.injection.patch import (
    Injection,
    PolicyFacts,
    TrainerSettings,
    inject,
    wants_injection,
)
from refit_operator.injection.pod import Pod, PodError, parse_pod
from refit_operator.injection.review import ReviewError, parse_review, review_response

__all__ = [
    "Injection",
    "InjectionConfig",
    "InjectionConfigError",
    "Pod",
    "PodError",
    "PolicyFacts",
    "ReviewError",
    "TrainerSettings",
    "inject",
    "load_injection_config",
    "parse_pod",
    "parse_review",
    "review_response",
    "wants_injection",
]
