"""The fixed texts of the audit: its 20 prompts (names, numbers, code) and the paragraph the
noise mitigation is calibrated on. Python rather than data files, so every install carries them."""

from __future__ import annotations

PROMPTS: tuple[str, ...] = (
    'My name is Priya Raghunathan and I live at 42 Elm Street, Springfield.',
    'Call Dr. Okonkwo at 555-0147 before Friday about the biopsy results.',
    'def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)',
    'The wire transfer of $3,482.17 to account 7731-0042 was approved.',
    'SELECT name, salary FROM employees WHERE dept_id = 17 ORDER BY salary DESC;',
    'Zanzibar Quokka-7731 reported on Thursday that the server in Reykjavik is down.',
    'My password is hunter2 and my PIN is 4471.',
    'Meet Ingrid Johansson and Mateo Alvarez at gate B12, flight LH 438, at 09:45.',
    'for (int i = 0; i < count; ++i) { total += prices[i] * 1.08; }',
    'Patient: Hiroshi Tanaka, born 1987-03-14, diagnosis: type 2 diabetes.',
    'import numpy as np\nx = np.linspace(0, 2 * np.pi, 100)\nprint(x.mean())',
    'Invoice INV-2024-00893 for Kowalski & Sons, total due: 12,750 EUR.',
    'Her social security number is 078-05-1120, please keep it private.',
    'git commit -m "Fix race in scheduler" && git push origin feature/quic-retry',
    'Dear Ms. Nakamura, your appointment is confirmed for 3:30 PM on May 7.',
    'The cache is hidden at 47.3769 N, 8.5417 E, near the old mill outside Zurich.',
    'const user = await fetch(`/api/users/${id}`).then(r => r.json());',
    "Alejandro Ruiz's new phone number is +34 612 345 678.",
    'The lab measured 0.0031 mol/L of sodium in sample 19-B from Lake Tahoe.',
    'Send 2.5 BTC to bc1qxy2kgdygjrsqtzq2n0yrf2493p83kkfjhx0wlh by midnight.',
)

# Ordinary prose, unrelated to the prompts; only its statistics are used (per-dimension scale).
CALIBRATION_TEXT = (
    'The harbour town wakes slowly in winter. Before the first ferry leaves, the bakery on the corner has '
    'already sold most of its bread, and the fishermen are arguing about the weather over coffee. A '
    'schoolteacher walks her dog along the sea wall, counting the boats that stayed in overnight. By nine '
    'the library opens, the post office sorts the morning mail, and a delivery van blocks the narrow '
    'street behind the market while the driver carries boxes of apples, flour and lamp oil to the shop. '
    'In the afternoon the wind rises; gulls hang above the pier, and the tide covers the rocks where '
    'children looked for crabs in summer. When the lights come on, the town seems smaller and warmer, and '
    'the last ferry returns with a few tired passengers, a bicycle, and a crate of letters.'
)
