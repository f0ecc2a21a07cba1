"""KubeRefit's tools, apart from the product: the benches (`kuberefit bench ...`), the local mode
(processes on one machine) and the demo (`kuberefit demo`), with the tiny models they use.

Tools may import every product package (protocol, control plane, data plane); no product code
imports them.
"""
