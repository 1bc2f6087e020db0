"""GET /v1/models, /v1/models/{id}, /health and /metrics: which model is served, whether it can be served
now, and the server's Prometheus metrics."""
from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse, Response

from meshserve.entrypoints.openai.errors import engine_dead, model_not_found
from meshserve.entrypoints.openai.serving_base import ServingBase


class StatusServing(ServingBase):
    def list_models(self) -> dict[str, Any]:
        return {"object": "list", "data": [self._model_card()]}

    def retrieve_model(self, model: str) -> dict[str, Any]:
        if model != self.model_name:
            raise model_not_found(model)
        return self._model_card()

    def health(self) -> Response:
        # a deployment's job executor also says what can be routed now and what is missing
        detail = self.engine.health()
        if self.engine.healthy:
            return JSONResponse({"status": "ok", **detail})
        error = engine_dead(self.engine.dead_error or "unknown error")
        return JSONResponse({**detail, **error.to_dict()}, status_code=503)

    async def metrics_page(self) -> Response:
        metrics = self.context.metrics
        await metrics.refresh(self.engine.get_stats)
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    def _model_card(self) -> dict[str, Any]:
        return {"id": self.model_name, "object": "model", "created": self.context.created, "owned_by": "meshserve",
                "root": self.model_name, "max_model_len": self.engine.max_model_len}
