"""The route advisor: which routes a pair of models has, and what each is forecast to give, before any merge
(``task=advise``); the route benchmark's diagnostics (``task=pairdev``) and each route's forecast
(``task=route_forecast``), built by ``study=forecast`` (every route) or ``study=routes`` (all but native)."""
